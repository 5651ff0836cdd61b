"""`kv-cache` (the first lesson's benchmark): the naive loop against the KV-cache loop."""

from __future__ import annotations

import time

from llmopt.bench.common import header, progress_bar, table
from llmopt.engine.reference_loops import generate_naive, generate_with_cache
from llmopt.sampling_params import SamplingParams
from llmopt.sequence import Sequence


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


def kv_cache_table(llm, lengths: list[int], prompt: str = "def ", progress: bool = True,
                   command: str | None = None, load: float | None = None) -> str:
    prompt_ids = llm.tokenizer(prompt)["input_ids"]
    # --lengths 999999999 ran the naive loop (quadratic) until killed; the prompt and tokens must fit
    if len(prompt_ids) + max(lengths) > llm.max_model_len:
        raise ValueError(f"--lengths {max(lengths)} and the {len(prompt_ids)}-token --prompt exceed max_model_len "
                         f"({llm.max_model_len}); each length must be at most {llm.max_model_len - len(prompt_ids)}")
    rows = []
    items = [(n, name, loop) for n in lengths
             for name, loop in (("naive", generate_naive), ("kv-cache", generate_with_cache))]
    for loop in (generate_naive, generate_with_cache):  # warm up (allocator, thread pools)
        time_generation(llm, loop, prompt_ids, 8)
    results = {}
    for n, name, loop in progress_bar(items, "kv-cache bench", progress):
        results[(n, name)] = time_generation(llm, loop, prompt_ids, n)
    for n in lengths:
        a, b = results[(n, "naive")], results[(n, "kv-cache")]
        same = "yes" if a["token_ids"] == b["token_ids"] else "NO"
        rows.append([n, f"{a['ms_per_token']:.2f}", f"{b['ms_per_token']:.2f}",


                     f"{a['ms_per_token'] / b['ms_per_token']:.1f}x", f"{a['last_ms_per_token']:.2f}",
                     f"{b['last_ms_per_token']:.2f}",
                     f"{a['last_ms_per_token'] / b['last_ms_per_token']:.1f}x", same])
    head = ["tokens generated", "naive ms/token", "cached ms/token", "speedup",
            "naive ms/token (last 10%)", "cached ms/token (last 10%)", "speedup (last 10%)", "same tokens"]
    command = command or f"llmopt bench --workload kv-cache --lengths {' '.join(map(str, lengths))}"
    return header(llm, command, load) + "\n\n" + table(head, rows)
