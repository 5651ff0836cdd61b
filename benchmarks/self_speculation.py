"""Self-speculative decoding (layer skip) on tiny and SmolLM2: acceptance per exit layer.

The draft is the target's first E layers and its own head (llmopt/spec/layer_skip.py). For
each E the same prompts are decoded greedily with k drafts per step: acceptance rate
(accepted / drafted), mean acceptance length (tokens per verification step), and wall time
against plain decoding in the same sitting. Greedy output is checked equal to plain's.

    python benchmarks/self_speculation.py [--models tiny smollm2] [--k 3] [--max-tokens 32] [--exits 8 15]

Writes results/self_speculation.md and .json, with the CPU and the load average in the header
(run it on a quiet machine: it warns above 1.5). Each engine is warmed up on one short request
before it is timed; acceptance is deterministic, times are one run each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from llmopt import LLM, SamplingParams
from llmopt.bench.common import load_average, machine

PROMPTS = {
    "tiny": ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n", "for i in range("],
    "smollm2": ["The capital of France is", "def add(a, b):\n    return",
                "Water boils at a temperature of", "Once upon a time, there was a"],
}
EXITS = {"tiny": [1, 2, 3, 4, 5], "smollm2": [8, 15, 22, 28]}


def _warm(llm: LLM) -> None:
    llm.generate(["warm up"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)


def measure(model: str, exit_layers: list[int], k: int, max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = PROMPTS[model]
    plain_llm = LLM(model=model, enable_prefix_caching=False)
    _warm(plain_llm)
    t = time.perf_counter()
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    plain_s = time.perf_counter() - t
    rows = [{"model": model, "exit_layer": None, "acceptance_rate": None, "acceptance_length": 1.0,
             "seconds": plain_s, "speedup": 1.0, "equal_to_plain": True}]
    del plain_llm
    for e in exit_layers:
        llm = LLM(model=model, enable_prefix_caching=False,
                  speculative_config={"method": "layer_skip", "exit_layer": e, "num_speculative_tokens": k})
        _warm(llm)
        before = llm.get_metrics()  # the warm-up's drafts are not counted
        t = time.perf_counter()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = time.perf_counter() - t
        m = {key: v - before.get(key, 0) for key, v in llm.get_metrics().items() if key.startswith("spec_decode_num")}
        drafts = max(1, m["spec_decode_num_drafts"])
        rows.append({"model": model, "exit_layer": e,
                     "acceptance_rate": m["spec_decode_num_accepted_tokens"] / max(1, m["spec_decode_num_draft_tokens"]),
                     "acceptance_length": 1 + m["spec_decode_num_accepted_tokens"] / drafts,
                     "seconds": s, "speedup": plain_s / s, "equal_to_plain": got == plain})
        del llm
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=list(PROMPTS))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exits", type=int, nargs="+", help="exit layers to try (default: a spread per model)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "self_speculation.md"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load, started = load_average(), time.perf_counter()
    rows = []
    for model in a.models:
        rows += measure(model, a.exits or EXITS[model], a.k, a.max_tokens)
    lines = [f"# Self-speculative decoding (layer skip), k = {a.k}, greedy, {a.max_tokens} tokens x "
             f"{len(PROMPTS['tiny'])} prompts, {a.threads} threads", "",
             f"`python benchmarks/self_speculation.py {' '.join(sys.argv[1:])}`".replace(" `", "`") +
             f" ({(time.perf_counter() - started) / 60:.1f} min); {machine()} ({os.cpu_count()} cores), torch "
             f"{torch.__version__}; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end. "
             "Acceptance is deterministic; times are one run of all prompts together, after a warm-up request.", "",
             "| model | exit layer | acceptance rate | tokens per verify step | ms per token | speedup | greedy = plain |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(f"| {r['model']} | {r['exit_layer'] or 'plain'} | {acc} | {r['acceptance_length']:.2f} | "
                     f"{1e3 * r['seconds'] / (a.max_tokens * len(PROMPTS[r['model']])):.1f} | {r['speedup']:.2f}x | "
                     f"{r['equal_to_plain']} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    Path(a.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
