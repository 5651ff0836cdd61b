"""Benchmarks, always side by side with their baseline in one run, reported as ratios.

`kv-cache`: generate L tokens greedily with the naive loop (recompute everything) and
with the KV-cache loop, on the same model and prompt. Reports the mean time per
generated token and the time of the last tokens (where the naive loop is slowest).
"""

from __future__ import annotations

import platform
import time

import torch

from llmopt.engine.generate import generate_naive, generate_with_cache
from llmopt.engine.sequence import Sequence
from llmopt.sampling_params import SamplingParams


def time_generation(llm, loop, prompt_ids: list[int], n_tokens: int) -> dict:
    seq = Sequence("bench", None, prompt_ids,
                   SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    loop(llm.model, [seq], eos_token_ids=llm.eos_token_ids, max_model_len=llm.max_model_len)
    total = time.perf_counter() - t0
    times = [t0] + seq.metrics.token_times
    gaps = [b - a for a, b in zip(times[:-1], times[1:])]
    tail = gaps[-max(1, len(gaps) // 10):]  # the last 10% of tokens
    return {"tokens": len(seq.output_token_ids), "total_s": total,
            "ms_per_token": 1e3 * total / len(seq.output_token_ids),
            "last_ms_per_token": 1e3 * sum(tail) / len(tail), "token_ids": seq.output_token_ids}


def kv_cache_table(llm, lengths: list[int], prompt: str = "def ", progress: bool = True) -> str:
    prompt_ids = llm.tokenizer(prompt)["input_ids"]
    rows = []
    items = [(n, name, loop) for n in lengths
             for name, loop in (("naive", generate_naive), ("kv-cache", generate_with_cache))]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(items, desc="kv-cache bench", unit="run")
    for loop in (generate_naive, generate_with_cache):  # warm up (allocator, thread pools)
        time_generation(llm, loop, prompt_ids, 8)
    results = {}
    for n, name, loop in (bar or items):
        results[(n, name)] = time_generation(llm, loop, prompt_ids, n)
    for n in lengths:
        a, b = results[(n, "naive")], results[(n, "kv-cache")]
        same = "yes" if a["token_ids"] == b["token_ids"] else "NO"
        rows.append(f"| {n} | {a['ms_per_token']:.2f} | {b['ms_per_token']:.2f} | "
                    f"{a['ms_per_token'] / b['ms_per_token']:.1f}x | {a['last_ms_per_token']:.2f} | "
                    f"{b['last_ms_per_token']:.2f} | {a['last_ms_per_token'] / b['last_ms_per_token']:.1f}x | {same} |")
    head = (f"model `{llm.config.model}` ({sum(p.numel() for p in llm.model.parameters()):,} params), "
            f"{llm.dtype}, {llm.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{platform.processor() or platform.machine()}\n\n"
            "| tokens generated | naive ms/token | cached ms/token | speedup | naive ms/token (last 10%) "
            "| cached ms/token (last 10%) | speedup (last 10%) | same tokens |\n"
            "|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)


def run_bench(args) -> str:
    from llmopt import LLM
    from llmopt.cli import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    table = kv_cache_table(llm, args.lengths, args.prompt)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# KV cache: naive vs cached generation\n\n"
                    f"`llmopt bench --workload kv-cache --lengths {' '.join(map(str, args.lengths))}`\n\n"
                    f"{table}\n")
    return table
