"""`llmopt bench`'s own flags (the engine's come from llmopt.engine_args)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

WORKLOADS = ["kv-cache", "offline", "kv-memory", "prefix", "chunked", "spec", "roofline"]


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="kv-cache", choices=WORKLOADS)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 1024], help="kv-cache")
    p.add_argument("--prompt", default="def ", help="kv-cache")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default 128 (offline, kv-memory), 64 (prefix), 8 decoding (chunked)")
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="prompt tokens; for prefix: the suffix after the shared prefix")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                   help="max_tokens per request (drawn uniformly; ignore_eos)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[32, 64],
                   help="offline: HF static batch size(s)")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix: shared prompt tokens")
    p.add_argument("--num-long", type=int, default=4, help="chunked: long prompts arriving")
    p.add_argument("--long-len", type=int, default=1000, help="chunked: their length")
    p.add_argument("--chunk-budget", type=int, default=256,
                   help="chunked: max_num_batched_tokens with chunked prefill on")
    p.add_argument("--spec-methods", nargs="+", default=["ngram", "draft_model", "eagle"],
                   choices=["ngram", "draft_model", "eagle"], help="spec: methods to compare")
    p.add_argument("--spec-k", type=int, nargs="+", default=[2, 4, 6],
                   help="spec: num_speculative_tokens values")
    p.add_argument("--spec-batch1", type=int, default=4,
                   help="spec: requests run one at a time for the batch-1 latency")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="offline: also profile this many engine decode steps (torch.profiler)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--url", default=None,
                   help="load a running server instead (llmopt serve, vLLM): Poisson arrivals, streaming")
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="--url: requests/s, one run each (inf: all at once); default 1 2 4 8")
    p.add_argument("--max-retries", type=int, default=5,
                   help="--url: retries of a request answered 503, each after its Retry-After")
    p.add_argument("--out", default=None, help="write the table (markdown) here too")
    p.add_argument("--json", default=None, help="write the raw numbers (JSON) here")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="roofline: decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="roofline: tokens cached per sequence")
    p.add_argument("--decode-steps", type=int, default=32, help="roofline: decode steps timed per batch size")
    p.add_argument("--bandwidth-threads", type=int, nargs="+", default=[1, 2],
                   help="roofline: thread counts the machine's bandwidth is measured at")


def check_bench_flags(args) -> None:
    """Every `llmopt bench` flag in range, before a model is loaded: --out in a missing folder ran the
    whole benchmark, then ended in a FileNotFoundError traceback; --threads -1 was torch's RuntimeError;
    --batch-size 0, --prompt-len 50 10 or --num-requests -1 were Python's words from deep inside."""
    for key in ("lengths", "batch_size", "batches", "spec_k", "bandwidth_threads", "spec_batch1", "decode_steps",
                "context", "prefix_len", "num_long", "long_len", "chunk_budget", "threads", "num_requests"):
        values = getattr(args, key, None)
        for v in values if isinstance(values, list) else [] if values is None else [values]:
            if v < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {v}")
    for key in ("profile_steps", "max_retries"):
        if getattr(args, key, 0) < 0:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 0, got {getattr(args, key)}")
    for key in ("prompt_len", "output_len"):
        pair = getattr(args, key, None)
        if pair is not None and not 1 <= pair[0] <= pair[1]:
            raise ValueError(f"--{key.replace('_', '-')} MIN MAX needs 1 <= MIN <= MAX, got {pair[0]} {pair[1]}")
    for rate in getattr(args, "request_rate", None) or []:
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"--request-rate must be > 0 requests/s (inf: all at once), got {rate}")
    for key in ("out", "json"):
        path = getattr(args, key, None)
        if path is not None and (Path(path).is_dir() or not Path(path).resolve().parent.is_dir()):
            raise ValueError(f"--{key} {path}: must name a file in an existing folder")
