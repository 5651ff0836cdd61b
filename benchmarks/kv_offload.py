"""The KV offload tier on SmolLM2 (bfloat16): time to first token of returning turns, recomputed
against loaded from the tier below the pool.

Workload (llmopt/bench/multiturn.py): `--conversations` conversations of `--turns` turns, each
turn a new user message of `--user-tokens` held-out tokens and a greedy answer of
`--answer-tokens` tokens, so contexts grow to turns x (user + answer) tokens; served round robin,
one request at a time. The pool holds `--pool-share` of the KV the conversations hold at their
end (a quarter), so a conversation's blocks are evicted before it returns. Two engines, side by
side in one run: without a tier (returning turns recompute their context) and with
`kv_offloading_size` (a file on disk below the pool; the returning turns load it).

    python benchmarks/kv_offload.py [--conversations 16] [--turns 8]

Writes results/kv_offload_smollm2.md and .json with the machine and the load average at the start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from llmopt import LLM, SamplingParams
from llmopt.bench.common import load_average, machine, percentile, table, write_result
from llmopt.bench.inputs import heldout_tokens
from llmopt.bench.multiturn import pool_blocks_for, run_turns, user_turns


def engine(blocks: int, offload_gib: float | None) -> LLM:
    llm = LLM("smollm2", dtype="bfloat16", num_kv_blocks=blocks, max_num_seqs=8, kv_offloading_size=offload_gib)
    llm.generate(["Warm the step up with a first prompt."], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.llm_engine.block_manager.reset_prefix_cache()
    return llm


def summary(records: list[dict]) -> dict:
    back = [r for r in records if r["turn"] > 1]
    prompt = sum(r["prompt_tokens"] for r in back)
    sources = [k for k in back[0] if k.endswith("_tokens") and k != "prompt_tokens"]
    return {"first_turn_ttft_s": statistics.mean(r["ttft_s"] for r in records if r["turn"] == 1),
            "returning_ttft_s": statistics.mean(r["ttft_s"] for r in back),
            "returning_ttft_p50_s": percentile([r["ttft_s"] for r in back], 50),
            "returning_ttft_p90_s": percentile([r["ttft_s"] for r in back], 90),
            **{f"returning_share_{k.removesuffix('_tokens')}": sum(r[k] for r in back) / prompt for k in sources}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=170)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--pool-share", type=float, default=0.25)
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_offload_smollm2"))
    args = ap.parse_args(argv)
    load = load_average()
    probe = LLM("smollm2", dtype="bfloat16", num_kv_blocks=16)
    turns = user_turns(heldout_tokens(probe.get_tokenizer()), args.conversations, args.turns, args.user_tokens)
    blocks = pool_blocks_for(turns, args.answer_tokens, probe.llm_engine.block_size, args.pool_share)
    del probe
    runs = {}
    for name, gib in (("recompute (no tier)", None), ("offload tier (disk)", args.offload_gib)):
        llm = engine(blocks, gib)
        records = run_turns(llm, turns, args.answer_tokens)
        runs[name] = {"engine": name, "pool_blocks": blocks, **summary(records), "turns": records}
        del llm
    base, tier = runs.values()
    speedup = base["returning_ttft_s"] / tier["returning_ttft_s"]
    command = "python benchmarks/kv_offload.py " + " ".join(argv if argv is not None else sys.argv[1:])
    longest = max(r["prompt_tokens"] for r in base["turns"])
    final = sum(sum(len(m) for m in c) + args.answer_tokens * len(c) for c in turns)
    head = ["engine", "turn 1 TTFT (s)", "returning TTFT mean (s)", "p50", "p90",
            "returning prompt tokens: pool", "tier", "computed"]
    body = [[name, f"{r['first_turn_ttft_s']:.3f}", f"{r['returning_ttft_s']:.3f}", f"{r['returning_ttft_p50_s']:.3f}",
             f"{r['returning_ttft_p90_s']:.3f}", f"{100 * r['returning_share_pool']:.1f}%",
             f"{100 * r.get('returning_share_disk', 0.0):.1f}%", f"{100 * r['returning_share_computed']:.1f}%"]
            for name, r in runs.items()]
    text = (f"# KV offload tier, SmolLM2-135M-Instruct, bfloat16\n\n"
            f"Machine: {machine()}; load average {load:.2f} at the start. Command: `{command.strip()}`.\n"
            f"Workload: {args.conversations} conversations x {args.turns} turns ({args.user_tokens}-token user "
            f"messages from the held-out text, {args.answer_tokens}-token greedy answers; prompts up to {longest} "
            f"tokens), round robin, one request at a time; pool of {blocks} blocks of 16 tokens "
            f"({100 * blocks * 16 / final:.0f}% of the conversations' final KV); tier: {args.offload_gib} GiB file.\n\n"
            + table(head, body) +
            f"\nReturning turns' time to first token, recompute / tier: **{speedup:.2f}x**.\n")
    write_result(args.out, text, load, list(runs.values()))


if __name__ == "__main__":
    main()
