"""A KV cache below 8 bits on SmolLM2 (bfloat16 weights): what int8 and int4 pools cost in
perplexity, what they save in bytes, and how fast they decode.

For kv_cache_dtype in auto (the model's bf16), int8 and int4 (llmopt/kernels/int_kv_ref.py: KIVI's grouping, E8M0 scales), one engine each:
  - perplexity on the held-out text under llmopt.eval's one protocol, and its change against the
    bf16 pool;
  - tokens a GB of pool holds (codes and scales counted, from the pool's own bytes per block), as a
    multiple of the bf16 pool's;
  - decode speed at `--seqs` sequences and at 1 (128-token prompts, 64 new tokens each, greedy):
    decode tokens a second over 48 engine steps in which every sequence decodes (the prompts'
    prefill stepped through first, untimed), best of `--repeats` with the engines alternated.
(FP8 pools decode eagerly on the CPU; their perplexity costs are in results/precision_smollm2.md.)

    python benchmarks/int_kv.py [--seqs 64] [--repeats 2]

Writes results/int_kv_smollm2.md and .json with the machine and the load average at the start.
"""

from __future__ import annotations

import argparse
import random
import time
import sys
from pathlib import Path

from llmopt import LLM, SamplingParams
from llmopt.bench.common import load_average, machine, write_result, table
from llmopt.eval import PROTOCOL, describe_protocol, perplexity

DTYPES = ("auto", "int8", "int4")  # fp8 pools decode eagerly here: their costs are in precision_smollm2.md
WORDS = ("the a river mountain compute tensor cache block apple green story write explain why how "
         "garden music engine light winter number").split()


def engine(kv: str) -> LLM:
    return LLM("smollm2", dtype="bfloat16", kv_cache_dtype=kv, max_num_seqs=64, enable_prefix_caching=False,
               num_kv_blocks=1200)


def decode_speed(llm: LLM, seqs: int, steps: int = 48) -> float:
    """Decode tokens a second with `seqs` sequences decoding together: the 128-token prompts are
    stepped through prefill until every sequence has its first token, then `steps` engine steps of
    pure decode are timed (prefill left out, every timed step a full batch)."""
    rng = random.Random(seqs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"decode-{seqs}-{i}" for i in range(seqs)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(3, 40000) for _ in range(128)]}, params)
    while any(not engine.requests[rid].output_token_ids for rid in ids):
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    rate = seqs * steps / (time.perf_counter() - t)
    while engine.has_unfinished_requests():
        engine.step()
    return rate


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "int_kv_smollm2"))
    args = ap.parse_args(argv)
    load = load_average()
    engines = {kv: engine(kv) for kv in DTYPES}
    rows = {}
    for kv, llm in engines.items():
        e = llm.llm_engine
        rows[kv] = {"kv_cache_dtype": kv, "path": e.decode_path, "bytes_per_token": e.bytes_per_block / e.block_size,
                    "perplexity": perplexity(llm, **PROTOCOL)}
        decode_speed(llm, 2)   # warm-up
    for seqs in (1, args.seqs):
        for _ in range(args.repeats):
            for kv, llm in engines.items():
                rows[kv][f"tok_s_{seqs}"] = max(rows[kv].get(f"tok_s_{seqs}", 0.0), decode_speed(llm, seqs))
    base = rows["auto"]
    for r in rows.values():
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        r["tokens_per_gb_vs_bf16"] = base["bytes_per_token"] / r["bytes_per_token"]
        r[f"speed_vs_bf16_{args.seqs}"] = r[f"tok_s_{args.seqs}"] / base[f"tok_s_{args.seqs}"]
    command = "python benchmarks/int_kv.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = ["kv_cache_dtype", "step", "bytes/token (all layers)", "tokens per GB vs bf16", "perplexity", "change",
            "decode tok/s, 1 seq", f"decode tok/s, {args.seqs} seqs", f"vs bf16 at {args.seqs}"]
    body = [[("auto (bf16)" if kv == "auto" else kv), r["path"].split(" (")[0], f"{r['bytes_per_token']:.0f}",
             f"{r['tokens_per_gb_vs_bf16']:.2f}x", f"{r['perplexity']:.4f}", f"{100 * r['perplexity_change']:+.2f}%",
             f"{r['tok_s_1']:.1f}", f"{r[f'tok_s_{args.seqs}']:.1f}", f"{r[f'speed_vs_bf16_{args.seqs}']:.2f}x"]
            for kv, r in rows.items()]
    text = (f"# KV cache dtypes, SmolLM2-135M-Instruct, bfloat16 weights\n\n"
            f"Machine: {machine()}; load average {load:.2f} at the start. Command: `{command.strip()}`.\n"
            f"Perplexity: {describe_protocol()}. Decode speed: 128-token prompts "
            f"(48 steps of pure decode timed, prefill untimed), best of {args.repeats}, the engines alternated; "
            f"'step' is the path decode steps took (compiled: one C++ call; eager: op by op).\n\n"
            + table(head, body) + "\n")
    write_result(args.out, text, load, list(rows.values()))


if __name__ == "__main__":
    main()
