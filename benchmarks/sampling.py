"""What sampling a token costs on the CPU, against the textbook way, and its share of a decode step.

The textbook sampler (the one every tutorial writes, and llmopt's own before): sort each row of
logits, softmax, cut the nucleus with a cumulative sum, scatter back, draw with torch.multinomial.
On SmolLM2's 49,152-token vocabulary that sort and that draw cost more than a Q8_0 decode step.
llmopt's CPU sampler (llmopt/layers/sampler_cpu.py, beside the plain llmopt/layers/sampler.py)
keeps the same distribution: it looks at the 128 (then
2,048) largest logits before sorting a whole row, draws by a two-level inverse CDF, and keeps the
exps of a low temperature's far tail out of subnormal floats (x86's slow path). The logits
are SmolLM2's own over 512 tokens of held-out text (teacher-forced), so the nuclei have the sizes
a real model gives. Then the engine end to end: decode tokens/s, greedy against sampled.

    python benchmarks/sampling.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from llmopt import LLM, SamplingParams
from llmopt.bench import heldout_tokens
from llmopt.bench.common import cpu_name
from llmopt.layers.attention import AttentionMetadata
from llmopt.layers.sampler_cpu import sample
from llmopt.model.forward import run_model
from llmopt.worker.kv_cache import NoKVCache

RESULTS = Path(__file__).parent / "results"
CONFIGS = [("temperature 0.8", dict(temperature=0.8)),
           ("temperature 0.8, top-p 0.95", dict(temperature=0.8, top_p=0.95)),
           ("temperature 0.7, top-p 0.9", dict(temperature=0.7, top_p=0.9)),
           ("temperature 1, top-k 50, top-p 0.9", dict(temperature=1.0, top_k=50, top_p=0.9)),
           ("temperature 0.8, min-p 0.05", dict(temperature=0.8, min_p=0.05)),
           ("temperature 0.2 (code)", dict(temperature=0.2)),
           ("temperature 0.2, top-p 0.9", dict(temperature=0.2, top_p=0.9))]
ROWS = (1, 8, 64)


def textbook_sample(logits: torch.Tensor, p: SamplingParams, generators: list) -> torch.Tensor:
    """Sort, softmax, nucleus by cumulative sum, scatter back, torch.multinomial per row."""
    x = logits.float() / p.temperature
    if p.top_k > 0 or p.top_p < 1 or p.min_p > 0:
        s, order = x.sort(-1, descending=True)
        if p.top_k > 0:
            s[:, p.top_k:] = float("-inf")
        probs = s.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop |= probs < p.min_p * probs[:, :1]
        drop[:, 0] = False
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, s.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])


def median_ms(fn, logits: torch.Tensor, rows: int, repeats: int = 3) -> float:
    """Best over `repeats` of the median over up to 16 batches of `rows` consecutive positions."""
    best = float("inf")
    for _ in range(repeats):
        times = []
        for start in list(range(0, len(logits) - rows + 1, max(rows, 16)))[:16]:
            t = time.perf_counter()
            fn(logits[start:start + rows])
            times.append(time.perf_counter() - t)
        best = min(best, statistics.median(times))
    return 1e3 * best


def decode_rate(llm: LLM, params: SamplingParams, seqs: int, prompt: list[int]) -> float:
    """Generated tokens per second of `seqs` sequences of 64 new tokens (prefill excluded)."""
    engine = llm.llm_engine
    ids = [f"s{time.monotonic_ns()}-{i}" for i in range(seqs)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, {"prompt_token_ids": prompt[i:i + 32]}, params)
    seq_objs = [engine.requests[r] for r in ids]
    while any(not s.output_token_ids for s in seq_objs):
        engine.step()
    t, before = time.perf_counter(), sum(len(s.output_token_ids) for s in seq_objs)
    while engine.has_unfinished_requests():
        engine.step()
    return (sum(len(s.output_token_ids) for s in seq_objs) - before) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    llm = LLM(model="smollm2", dtype="float32")
    text = heldout_tokens(llm.tokenizer)
    ids = torch.tensor(text[1000:1512])
    with torch.inference_mode():
        hidden = run_model(llm.model, NoKVCache(), ids, AttentionMetadata.uncached([len(ids)], ids.device))
        logits = llm.model.compute_logits(hidden).float()
    lines = [f"`{' '.join(['python benchmarks/sampling.py', *sys.argv[1:]])}`: SmolLM2-135M-Instruct's logits over 512 "
             f"held-out positions (vocabulary 49,152), {args.threads} thread(s); {cpu_name()} ({os.cpu_count()} cores), "
             f"1-minute load average {load:.2f} before the run.", "",
             "| sampling | rows | textbook (sort + multinomial), ms | llmopt, ms | speedup |", "|---|---|---|---|---|"]
    for name, kw in CONFIGS:
        p = SamplingParams(**kw)
        for rows in ROWS:
            gens = [torch.Generator().manual_seed(i) for i in range(rows)]
            ref = median_ms(lambda x: textbook_sample(x, p, gens), logits, rows)
            mine = median_ms(lambda x: sample(x, [p] * rows, gens), logits, rows)
            lines.append(f"| {name} | {rows} | {ref:.2f} | {mine:.2f} | {ref / mine:.1f}x |")
            print(lines[-1], flush=True)
    lines += ["", "The engine end to end (`LLM(model=\"smollm2\")`, float32, 32-token prompts, 64 new tokens "
              "each, ignore_eos; decode tokens/s after the prompts):", "",
              "| sequences | greedy | temperature 0.8, top-p 0.95 | sampled / greedy |", "|---|---|---|---|"]
    for seqs in (1, 16):
        greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        topp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, ignore_eos=True, seed=0)
        decode_rate(llm, greedy, seqs, text)  # warm-up
        g, s = decode_rate(llm, greedy, seqs, text), decode_rate(llm, topp, seqs, text)
        lines.append(f"| {seqs} | {g:.1f} | {s:.1f} | {s / g:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", f"1-minute load average at the end: {os.getloadavg()[0]:.2f} (the run's own threads included)."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sampling.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'sampling.md'}")


if __name__ == "__main__":
    main()
