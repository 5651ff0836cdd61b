"""Batch invariance on SmolLM2 in bfloat16: does a request's output depend on its neighbours, and
what does making it not cost?

For the switch off and on (enable_deterministic_inference), one engine each, chunked prefill on
with a small token budget so prompts are cut differently from batch to batch:
  1. Two targets (a short question, and a long passage of the held-out text whose attention is
     sliced) are answered greedily alone, then each inside `--batches` random batches: 1 to 16
     neighbours of random lengths and random max_tokens, the target at a random place. Counted:
     batches whose target tokens differ from alone, and whose logprobs differ (bit for bit).
  2. Speed: 16 sequences decoding together (and 1 alone), output tokens per second, the two
     engines alternated `--repeats` times, the best of each kept.

    python benchmarks/batch_invariance.py [--batches 50] [--repeats 3]

Writes results/batch_invariance_smollm2.md and .json with the machine and the load average at the
start (run it on a quiet machine: it warns above 1.5).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from llmopt import LLM, SamplingParams
from llmopt.bench.common import load_average, machine, write_result, output_tokens_per_second, table
from llmopt.model.registry import heldout_text

ENGINE = dict(model="smollm2", dtype="bfloat16", enable_chunked_prefill=True, max_num_batched_tokens=128,
              max_num_seqs=17, enable_prefix_caching=False)
WORDS = ("the a river mountain compute tensor cache block apple green story write explain why how "
         "garden music engine light winter number").split()


def targets() -> list[str]:
    passage = " ".join(heldout_text("eval").split()[:300])  # about 400 tokens: more keys than one attention slice
    return ["Name a fruit.", passage]


def answer(out) -> tuple[list[int], list[float]]:
    o = out.outputs[0]
    return list(o.token_ids), [next(iter(d.values())).logprob for d in o.logprobs]


def invariance(llm: LLM, batches: int, seed: int = 0) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    alone = [answer(llm.generate([t], params, use_tqdm=False)[0]) for t in targets()]
    rng = random.Random(seed)
    tokens_differ = logprobs_differ = 0
    worst = 0.0
    for b in range(batches):
        which = b % 2
        n = rng.randint(1, 16)
        others = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 150))) for _ in range(n)]
        at = rng.randint(0, n)
        prompts = others[:at] + [targets()[which]] + others[at:]
        ps = [params if i == at else SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 48), ignore_eos=True)
              for i in range(n + 1)]
        got = answer(llm.generate(prompts, ps, use_tqdm=False)[at])
        want = alone[which]
        tokens_differ += got[0] != want[0]
        same = min(len(got[1]), len(want[1]))
        drift = max((abs(a - c) for a, c in zip(got[1][:same], want[1][:same])), default=0.0)
        logprobs_differ += got != want
        worst = max(worst, drift)
    return {"batches": batches, "tokens_differ": tokens_differ, "logprobs_differ": logprobs_differ,
            "max_logprob_drift": worst}


def speed(llm: LLM, seqs: int, new_tokens: int = 64) -> float:
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(48)) for _ in range(seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return output_tokens_per_second(llm, prompts, params)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_invariance_smollm2"))
    args = ap.parse_args(argv)
    load = load_average()
    engines = {mode: LLM(**ENGINE, enable_deterministic_inference=mode) for mode in (False, True)}
    for llm in engines.values():
        speed(llm, 2, 4)  # warm-up
    rows = {mode: {"invariant": mode, **invariance(llm, args.batches)} for mode, llm in engines.items()}
    for seqs in (1, 16):
        best = {mode: 0.0 for mode in engines}
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                best[mode] = max(best[mode], speed(llm, seqs))
        for mode in engines:
            rows[mode][f"tok_s_{seqs}"] = best[mode]
    for seqs in (1, 16):
        rows[True][f"cost_{seqs}"] = 1 - rows[True][f"tok_s_{seqs}"] / rows[False][f"tok_s_{seqs}"]
    command = "python benchmarks/batch_invariance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = ["switch", "batches", "target tokens differ", "target logprobs differ", "max logprob drift (nats)",
            "tok/s, 1 seq", "tok/s, 16 seqs", "cost at 16 seqs"]
    body = [[("on" if r["invariant"] else "off"), r["batches"], r["tokens_differ"], r["logprobs_differ"],
             f"{r['max_logprob_drift']:.4f}", f"{r['tok_s_1']:.1f}", f"{r['tok_s_16']:.1f}",
             f"{100 * r['cost_16']:.1f}%" if "cost_16" in r else "-"] for r in rows.values()]
    text = (f"# Batch invariance, SmolLM2-135M-Instruct, bfloat16\n\n"
            f"Machine: {machine()}; load average {load:.2f} at the start. Command: `{command.strip()}`.\n"
            f"Engine: {ENGINE} (chunked prefill, 128-token budget). A batch: 1-16 neighbours of 2-150 words "
            f"and 1-48 new tokens around one of two targets (a short question, a 300-word held-out passage), "
            f"32 greedy tokens each; counted against the target alone on the same engine. Speed: 64 new "
            f"tokens a sequence, best of {args.repeats}, the two engines alternated.\n\n" + table(head, body) + "\n")
    write_result(args.out, text, load, list(rows.values()))


if __name__ == "__main__":
    main()
