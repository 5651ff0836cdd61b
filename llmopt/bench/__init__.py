"""Benchmarks, always side by side with their baseline in one run, reported as ratios.

Every workload runs its baselines in the same process, on the same requests, and prints
one markdown table whose first line names the model, dtype, threads, CPU and command:
absolute numbers on a shared CPU drift from run to run, the ratios are what to read.

- `kv-cache`: naive loop (recompute everything) vs KV-cache loop, one prompt, L tokens.
- `offline`: a mixed batch of requests (prompt 32-512, output 32-256 tokens, real code
  from the held-out text) through Hugging Face `generate` in static batches, through
  llmopt one request at a time, and through the engine (continuous batching).
- `kv-memory`: the same requests; the share of reserved KV slots that hold tokens, paged
  vs contiguous reservations (per request max_model_len, or prompt + max_tokens).
- `prefix`: requests sharing a system prompt: TTFT and throughput, prefix caching on/off.
- `chunked`: long prompts arriving while others decode: the decoders' inter-token gaps
  and the long prompts' TTFT, chunked prefill on/off.
- `spec`: plain decoding vs each speculative method (n-gram, draft model, EAGLE head) at
  k in {2, 4, 6}, with Leviathan et al.'s prediction: in `llmopt.bench.spec`.
- `roofline`: the machine's memory bandwidth, and decode step time against batch size with
  the bytes each step reads and the share of the bandwidth it achieves (`llmopt.bench.roofline`).

Against a running server (`llmopt serve`, alone or behind nginx): `load` (Poisson arrivals of
streaming clients, TTFT / TPOT, saturation), `resilient_client` (timeouts, retries with backoff
and jitter, a circuit breaker per replica) and `soak` (a long run with faults injected).

One module per workload (kv_cache, offline, kv_slot_usage, prefix, chunked, spec, roofline), `inputs` for the
requests they run, `edit` for the edit workload (rename a variable in ~300 tokens of code: answers
that repeat the prompt, where n-gram speculation does best) and `common` for what they share;
this module picks the workload from the command line and writes its table.
"""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path

import torch

from llmopt.bench.chunked import bench_chunked, chunked_table
from llmopt.bench.common import (
    Clock,
    common_prefix_share,
    cpu_name,
    header,
    hf_static_batches,
    load_average,
    load_hf_model,
    one_at_a_time,
    percentile,
    progress_bar,
    run_engine,
    table,
    warm_up,
)
from llmopt.bench.inputs import BenchRequest, cut, heldout_text, heldout_tokens, make_requests
from llmopt.bench.kv_cache import kv_cache_table, time_generation
from llmopt.bench.kv_slot_usage import bench_kv_memory, kv_memory_table
from llmopt.bench.offline import OP_SOURCES, bench_offline, offline_table, profile_decode, profile_table
from llmopt.bench.prefix import bench_prefix, prefix_table

__all__ = ["WORKLOADS", "DEFAULTS", "BenchRequest", "Clock", "OP_SOURCES", "bench_chunked", "bench_kv_memory",
           "bench_offline", "bench_prefix", "chunked_table", "command_line", "common_prefix_share", "cpu_name",
           "cut", "for_json", "header", "heldout_text", "heldout_tokens", "hf_static_batches", "kv_cache_table",
           "kv_memory_table", "load_hf_model", "make_requests", "offline_table", "one_at_a_time", "percentile",
           "prefix_table", "profile_decode", "profile_table", "progress_bar", "run_bench", "run_engine",
           "run_workload", "table", "time_generation", "warm_up"]

WORKLOADS = ["kv-cache", "offline", "kv-memory", "prefix", "chunked", "spec"]
# Sizes when a flag is not given: num_requests, prompt_len (min, max), output_len (min, max).
# For `prefix` prompt_len is the length of each distinct suffix after the shared prefix;
# for `chunked` the counts and lengths are those of the requests that decode.
DEFAULTS = {
    "offline": dict(num_requests=128, prompt_len=(32, 512), output_len=(32, 256)),
    "kv-memory": dict(num_requests=128, prompt_len=(32, 512), output_len=(32, 256)),
    "prefix": dict(num_requests=64, prompt_len=(16, 64), output_len=(32, 32)),
    "chunked": dict(num_requests=8, prompt_len=(64, 128), output_len=(96, 96)),
    "spec": dict(num_requests=16, prompt_len=(64, 256), output_len=(128, 128)),
}


# -- entry points -------------------------------------------------------------------------------
def command_line(args, prog: str = "llmopt bench") -> str:
    """The command that reproduces `args`: the workload, then every flag not at its default."""
    import argparse

    from llmopt.bench.flags import add_bench_flags
    from llmopt.engine_args import add_engine_flags

    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    add_engine_flags(parser)
    defaults = vars(parser.parse_args([]))
    parts = prog.split() + ["--workload", args.workload]
    for key, value in vars(args).items():
        if key in ("command", "workload") or value == defaults.get(key):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            parts += [flag, *map(str, value)]
        elif isinstance(value, dict):
            parts += [flag, json.dumps(value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run_workload(args, command: str | None = None, load: float | None = None) -> tuple[str, dict]:
    """Run the workload `args.workload` names: (markdown with its header line, raw numbers).
    `load`: the load average measured before a run of several workloads began (the later ones
    would otherwise record the run's own load)."""
    threads = torch.get_num_threads()
    if args.threads:
        # On a CPU shared with other jobs, fewer threads than cores can be much faster:
        # an oversubscribed thread pool waits for its slowest thread at every operation.
        torch.set_num_threads(args.threads)
    try:
        return _run_workload(args, command, load_average() if load is None else load)
    finally:
        torch.set_num_threads(threads)


def _run_workload(args, command: str | None, load: float) -> tuple[str, dict]:
    from llmopt import LLM
    from llmopt.engine_args import engine_kwargs

    command = command or command_line(args)
    w = args.workload
    kwargs = engine_kwargs(args)
    progress = args.progress

    def make_llm(**override):
        return LLM(**{**kwargs, **override})

    if w == "kv-cache":
        llm = make_llm()
        text = kv_cache_table(llm, args.lengths, args.prompt, progress, command, load)
        return text, {"workload": w, "table": text}
    if w == "roofline":
        from llmopt.bench.roofline import bench_roofline, measure_bandwidth, roofline_table

        bandwidth = measure_bandwidth(tuple(args.bandwidth_threads))
        llm = make_llm(max_num_seqs=max(args.max_num_seqs, max(args.batches)))
        raw = bench_roofline(llm, args.batches, args.context, args.decode_steps, heldout_tokens(llm.tokenizer),
                             bandwidth, progress)
        raw.update(model=llm.config.model, dtype=str(llm.dtype), threads=torch.get_num_threads(), cpu=cpu_name(),
                   torch=torch.__version__, command=command, load_average=load)
        return header(llm, command, load) + "\n\n" + roofline_table(raw), raw
    d = DEFAULTS[w]
    n = args.num_requests or d["num_requests"]
    prompt_len = tuple(args.prompt_len or d["prompt_len"])
    output_len = tuple(args.output_len or d["output_len"])
    llm = make_llm(enable_trace=True) if w == "kv-memory" else make_llm()
    stream = heldout_tokens(llm.tokenizer)
    if w in ("offline", "kv-memory"):
        requests = make_requests(stream, n, prompt_len, output_len, args.workload_seed)
        if w == "offline":
            raw = bench_offline(llm, requests, args.batch_size, progress)
            body = offline_table(raw)
            if args.profile_steps:
                raw["profile"] = profile_decode(llm, requests, args.profile_steps)
                body += "\n\n" + profile_table(raw["profile"])
        else:
            raw = bench_kv_memory(llm, requests, progress)
            body = kv_memory_table(raw)
    elif w == "prefix":
        rng = random.Random(args.workload_seed)
        prefix = cut(stream, args.prefix_len, rng)
        requests = make_requests(stream, n, prompt_len, output_len, args.workload_seed + 1)
        raw = bench_prefix(make_llm, prefix, requests, progress)
        body = prefix_table(raw)
    elif w == "chunked":
        decoders = make_requests(stream, n, prompt_len, output_len, args.workload_seed)
        longs = make_requests(stream, args.num_long, (args.long_len, args.long_len), (16, 16),
                              args.workload_seed + 1)
        raw = bench_chunked(make_llm, decoders, longs, args.chunk_budget,
                            max(args.max_num_batched_tokens, args.long_len + n), progress=progress)
        body = chunked_table(raw)
    elif w == "spec":
        requests = make_requests(stream, n, prompt_len, output_len, args.workload_seed)
        from llmopt.bench.spec import bench_spec, spec_table

        raw = bench_spec(make_llm, requests, args.spec_methods, args.spec_k,
                         min(args.spec_batch1, n), progress)
        body = spec_table(raw)
    else:
        raise ValueError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    raw.update(model=llm.config.model, dtype=str(llm.dtype), threads=torch.get_num_threads(),
               cpu=cpu_name(), torch=torch.__version__, command=command, load_average=load)
    return header(llm, command, load) + "\n\n" + body, raw


def for_json(raw: dict) -> dict:
    """The raw numbers without the generated token lists (kept in memory for the checks)."""
    if "systems" not in raw:
        return raw
    systems = {k: {a: b for a, b in v.items() if a != "tokens"} for k, v in raw["systems"].items()}
    return {**raw, "systems": systems}


def run_bench(args) -> str:
    text, raw = run_workload(args)
    if args.out:
        Path(args.out).write_text(f"# llmopt bench: {args.workload}\n\n{text}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(for_json(raw)) + "\n")
    return text
