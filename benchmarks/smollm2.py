"""A real model through the engine: SmolLM2-135M-Instruct in llmopt and in transformers, side by side.

The same 64 mixed requests (prompts of 24-400 tokens of held-out Python source, 16-200 new
tokens each, greedy, ignore_eos, all submitted at once) go through llmopt's engine, through
transformers' `generate` in static batches of 32 (left-padded; a batch runs until its longest
request is done) and through llmopt one request at a time, in float32 and in bfloat16. The
engine and transformers runs alternate (A, B, A, B, ...) and the table reports medians, so a
burst of other work on this shared machine lands on both. Then torch.profiler splits one
engine decode step of 64 sequences by op, and the run is split into prefill and decode time.

    python benchmarks/smollm2.py                    # the committed table (about 30 min on 2 cores)
    python benchmarks/smollm2.py --num-requests 8 --output-len 8 16 --reps 1 --dtypes float32 --out-dir /tmp/s

Writes results/smollm2.md and results/smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from llmopt import LLM
from llmopt.bench import (common_prefix_share, header, heldout_tokens, hf_static_batches, load_hf_model,
                          make_requests, one_at_a_time, profile_decode, profile_table, run_engine, table,
                          warm_up)

GOAL = 3.0  # the goal: engine throughput / transformers' static batching at the same dtype


def engine_phases(llm, requests) -> dict:
    """One more engine run with a timer around each step: seconds in steps that prefill
    (any prompt tokens) and in pure decode steps, and the decode steps' mean batch."""
    engine = llm.llm_engine
    for i, r in enumerate(requests):
        engine.add_request(f"phase-{i}", r.prompt(), r.params())
    prefill = decode = 0.0
    decode_steps = decode_seqs = 0
    while engine.has_unfinished_requests():
        pending = sum(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running)
        waiting = len(engine.scheduler.waiting)
        running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if pending or waiting:
            prefill += dt
        else:
            decode += dt
            decode_steps += 1
            decode_seqs += running
    return {"prefill_steps_s": prefill, "decode_steps_s": decode, "decode_steps": decode_steps,
            "mean_decode_batch": decode_seqs / max(decode_steps, 1)}


def bench_dtype(dtype: str, args) -> tuple[str, dict]:
    # prefix caching off: the same requests run several times, and a warm cache would let every
    # run after the first skip its prompts (transformers recomputes them each time)
    llm = LLM(model="smollm2", dtype=dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    requests = make_requests(heldout_tokens(llm.tokenizer), args.num_requests, tuple(args.prompt_len),
                             tuple(args.output_len), args.seed)
    asked = sum(r.max_tokens for r in requests)
    warm_up(llm)
    hf = load_hf_model(llm)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    hf_static_batches(hf, requests[:2], 2, pad, False)  # warm up
    runs = {"engine": [], "hf": []}
    engine_tokens = hf_tokens = None
    for rep in range(args.reps):
        clock, outs = run_engine(llm, requests, args.progress)
        runs["engine"].append(clock.wall)
        engine_tokens = [o.outputs[0].token_ids for o in outs]
        clock, hf_tokens, computed = hf_static_batches(hf, requests, args.batch_size, pad, args.progress)
        runs["hf"].append(clock.wall)
        print(f"{dtype} rep {rep}: engine {asked / runs['engine'][-1]:.1f} tok/s, transformers "
              f"{asked / runs['hf'][-1]:.1f} tok/s", flush=True)
    del hf
    preemptions = llm.get_metrics()["num_preemptions"]
    one = None
    if not args.skip_one_at_a_time:
        one_at_a_time(llm, requests[:1], False)  # warm up
        clock, one_tokens = one_at_a_time(llm, requests, args.progress)
        one = {"seconds": clock.wall, "tokens_per_s": asked / clock.wall,
               "identical_to_engine": sum(a == b for a, b in zip(one_tokens, engine_tokens))}
    phases = engine_phases(llm, requests)
    profile = profile_decode(llm, requests, args.profile_steps, top=10)

    engine_s, hf_s = statistics.median(runs["engine"]), statistics.median(runs["hf"])
    n = len(requests)
    same = sum(a == b for a, b in zip(hf_tokens, engine_tokens))
    share = sum(map(common_prefix_share, hf_tokens, engine_tokens)) / n
    raw = {"dtype": dtype, "num_requests": n, "tokens_asked": asked, "prompt_tokens":
           sum(len(r.prompt_token_ids) for r in requests), "hf_tokens_computed": computed,
           "engine_seconds": runs["engine"], "hf_seconds": runs["hf"], "engine_tokens_per_s": asked / engine_s,
           "hf_tokens_per_s": asked / hf_s, "speedup_vs_hf": hf_s / engine_s, "one_at_a_time": one,
           "engine_num_preemptions": preemptions, "num_kv_blocks": llm.llm_engine.num_blocks,
           "hf_identical_to_engine": same, "hf_common_prefix_share": share, "phases": phases,
           "profile": profile}
    rows = [[f"transformers `generate`, static batches of {args.batch_size}", f"{asked / hf_s:.1f}",
             f"{hf_s:.1f}", f"{computed:,}", f"{hf_s / engine_s:.2f}x",
             f"{same}/{n} ({100 * share:.0f}% of tokens before the first difference)"]]
    if one is not None:
        rows.append(["llmopt, one request at a time (contiguous cache)", f"{one['tokens_per_s']:.1f}",
                     f"{one['seconds']:.1f}", f"{asked:,}", f"{one['seconds'] / engine_s:.2f}x",
                     f"{one['identical_to_engine']}/{n}"])
    rows.append(["llmopt engine (continuous batching, paged KV)", f"{asked / engine_s:.1f}", f"{engine_s:.1f}",
                 f"{asked:,}", "1.00x", "-"])
    text = (header(llm, args.command) + "\n\n"
            f"{n} requests, prompts {min(len(r.prompt_token_ids) for r in requests)}-"
            f"{max(len(r.prompt_token_ids) for r in requests)} tokens ({raw['prompt_tokens']:,} in all), "
            f"{asked:,} new tokens asked for (tokens/s counts only those); medians of {args.reps} alternating "
            f"runs each (engine: {', '.join(f'{s:.1f}' for s in runs['engine'])} s; transformers: "
            f"{', '.join(f'{s:.1f}' for s in runs['hf'])} s). KV pool: {llm.llm_engine.num_blocks} blocks "
            f"(the default for this machine), {preemptions:.0f} preemptions.\n\n"
            + table(["system", "new tokens/s", "time (s)", "tokens generated (incl. discarded)",
                     "engine speedup", "greedy tokens identical to the engine's"], rows)
            + f"\n\nengine / transformers' static batching: **{hf_s / engine_s:.2f}x** "
            f"(goal >= {GOAL}x: {'met' if hf_s / engine_s >= GOAL else 'NOT met'}).\n\n"
            f"Engine time by phase (a separate timed run): steps with prompt tokens "
            f"{phases['prefill_steps_s']:.1f} s, pure decode steps {phases['decode_steps_s']:.1f} s "
            f"({phases['decode_steps']} steps, {phases['mean_decode_batch']:.1f} sequences on average).\n\n"
            + profile_table(profile))
    return text, raw


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[24, 400])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 200])
    ap.add_argument("--batch-size", type=int, default=32, help="transformers' static batch size")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="alternating engine / transformers runs")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--skip-one-at-a-time", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    args.command = shlex.join(["python", "benchmarks/smollm2.py", *argv])
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    sections, raw = [], {"command": args.command, "load_average": os.getloadavg()}
    for dtype in args.dtypes:
        text, numbers = bench_dtype(dtype, args)
        print(f"\n## {dtype}\n\n{text}\n", flush=True)
        sections.append(f"## {dtype}\n\n{text}\n")
        raw[dtype] = numbers
    raw["total_seconds"] = time.perf_counter() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "smollm2.md").write_text(
        "# SmolLM2-135M-Instruct: llmopt against transformers\n\n"
        f"`{args.command}` ({raw['total_seconds'] / 60:.1f} min in all; load average at the start "
        f"{raw['load_average'][0]:.2f}). Absolute numbers move with the machine and its load; the "
        "ratios come from runs that alternate on the same requests.\n\n" + "\n".join(sections))
    (args.out_dir / "smollm2.json").write_text(json.dumps(raw, default=str) + "\n")
    print(f"wrote {args.out_dir / 'smollm2.md'} ({raw['total_seconds'] / 60:.1f} min)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
