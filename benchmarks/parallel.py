"""Tensor and pipeline parallelism on this machine: what the ranks send, what it costs, what it buys.

    python benchmarks/parallel.py                      # tiny, TP 1/2 x PP 1/2
    python benchmarks/parallel.py --model smollm2 --requests 16 --max-tokens 24 --configs 1x1 2x1 1x2

For each configuration the same workload runs once to warm up and once timed; the ranks then
report what they measured: bytes all-reduced (against the formula), seconds in all-reduce
(waiting for the slower rank included) as a share of the forward that contains them, and, with pipeline stages,
when each stage ran which micro-batch (the bubble, with micro-batches in flight and with one).
Greedy tokens are compared with the one-process run. The table for real GPUs next to it is
computed from `llmopt.distributed.cost_model`.

On a CPU with two cores, two ranks share the cores one process alone would use (each rank
gets one thread), and every all-reduce is a round trip through the kernel's loopback: the
point here is what is sent and how the time splits, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmopt import LLM, SamplingParams  # noqa: E402
from llmopt.bench.common import cpu_name, isa  # noqa: E402
from llmopt.distributed import cost_model  # noqa: E402


def workload(n: int, max_tokens: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(5, vocab, (int(torch.randint(16, 160, (1,), generator=g)),),
                                                  generator=g).tolist()} for _ in range(n)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_config(model: str, tp: int, pp: int, threads: int, prompts, params, engine: dict) -> dict:
    """One configuration; `threads` torch threads for the whole run (split among the ranks)."""
    torch.set_num_threads(threads)
    llm = LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine)
    try:
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        ex = llm.llm_engine.executor
        if ex is not None:
            ex.report(reset=True)
            tokens0, batches0 = ex.tokens_forwarded, ex.micro_batches
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        row = {"tp": tp, "pp": pp, "threads": threads, "seconds": wall,
               "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
               "ttft_p50_ms": 1e3 * statistics.median(o.metrics.ttft for o in outs),
               "tpot_p50_ms": 1e3 * statistics.median(o.metrics.tpot for o in outs if o.metrics.tpot),
               "token_ids": [o.outputs[0].token_ids for o in outs]}
        if ex is None:
            return row
        reports = ex.report(reset=True)
        tokens, batches = ex.tokens_forwarded - tokens0, ex.micro_batches - batches0
        cfg = llm.llm_engine.model_config
        r0 = reports[0]
        layers = r0["layers"][1] - r0["layers"][0]
        row.update({
            "micro_batches": batches, "tokens_forwarded": tokens,
            "allreduce_bytes_per_token": r0["allreduce_bytes"] / tokens,
            "allreduce_bytes_per_token_layer": r0["allreduce_bytes"] / tokens / layers,
            # two per layer of the stage, one more for the embedding on the first stage
            "formula_bytes_per_token": (2 * layers + 1) * cfg.hidden_size * 4 if tp > 1 else 0,
            "allreduce_ms_per_step": 1e3 * statistics.mean(r["allreduce_seconds"] for r in reports) / batches,
            # a rank's forward, timed whole: its all-reduces are inside it
            "forward_ms_per_step": 1e3 * statistics.mean(r["compute_seconds"] for r in reports) / batches,
        })
        if pp > 1:
            row["bubble"] = ex.bubble(reports)
            row["bubble_formula"] = cost_model.pp_bubble(pp, pp)
            ex.max_in_flight = 1  # the same workload with one micro-batch at a time
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            row["seconds_one_in_flight"] = time.perf_counter() - t0
            row["bubble_one_in_flight"] = ex.bubble(ex.report(reset=True))
        return row
    finally:
        llm.close()


def gpu_table() -> list[dict]:
    """Llama-3-70B (80 layers, hidden 8192, bf16) at TP 8: one decode step of 64 sequences."""
    L, H, params, tokens = 80, 8192, 70.6e9, 64
    compute = cost_model.decode_weight_read_seconds(params, 2, 8)
    rows = []
    for link in cost_model.LINKS:
        comm = cost_model.tp_comm_seconds_per_step(tokens, L, H, 2, 8, link)
        rows.append({"link": link, "comm_ms": 1e3 * comm, "weights_ms": 1e3 * compute,
                     "comm_share": comm / (comm + compute)})
    return rows


def reading(rows: list[dict]) -> list[str]:
    """What the table says, in numbers taken from it."""
    by = {(r["tp"], r["pp"], r["threads"]): r for r in rows}
    whole = max((r for r in rows if r["tp"] * r["pp"] == 1), key=lambda r: r["threads"])
    lines = []
    tp = by.get((2, 1, whole["threads"]))
    if tp:
        share = tp["allreduce_ms_per_step"] / tp["forward_ms_per_step"]  # the forward includes them
        lines.append(
            f"- **TP 2** gives {tp['tokens_per_s'] / whole['tokens_per_s']:.2f}x the throughput of one process "
            f"using the same {whole['threads']} threads: each rank computes half of every matmul, but every "
            f"layer then waits for two all-reduces through gloo over loopback TCP, {share:.0%} of each step "
            f"({tp['allreduce_ms_per_step']:.1f} ms of {tp['forward_ms_per_step']:.1f}). "
            "The bytes are exactly the formula's; on NVLink the same bytes take microseconds (table below).")
    pp = by.get((1, 2, whole["threads"]))
    if pp:
        lines.append(
            f"- **PP 2** gives {pp['tokens_per_s'] / whole['tokens_per_s']:.2f}x: no all-reduce, one send of the "
            f"hidden states per micro-batch; with {pp['pp']} micro-batches in flight the stages idle "
            f"{pp['bubble']:.0%} of the time (one in flight: {pp['bubble_one_in_flight']:.0%}), and the run takes "
            f"{pp['seconds']:.1f} s against {pp['seconds_one_in_flight']:.1f} s one at a time.")
    both = by.get((2, 2, whole["threads"]))
    if both:
        lines.append(
            f"- **TP 2 x PP 2** puts 4 processes on {os.cpu_count()} cores ({both['tokens_per_s'] / whole['tokens_per_s']:.2f}x): "
            "they take turns on the cores, which is why micro-batches in flight can make it slower here "
            f"({both['seconds']:.1f} s against {both['seconds_one_in_flight']:.1f} s one at a time).")
    lines.append("- Parallelism here is for equality and for the bytes: splitting a model that fits one "
                 "device only pays when each rank has its own device and the link is fast.")
    return lines


def markdown(model: str, rows: list[dict], args, load: tuple[float, float]) -> str:
    base = rows[0]
    out = [f"# Tensor and pipeline parallelism: `{model}` on {cpu_name()}", "",
           f"`python benchmarks/parallel.py --model {model} --requests {args.requests} --max-tokens "
           f"{args.max_tokens} --configs {' '.join(args.configs)} --repeat {args.repeat}`: {cpu_name()} "
           f"({isa() or 'no AVX2'}), {os.cpu_count()} cores, "
           f"load average {load[0]:.1f} when the run started and {load[1]:.1f} when it ended; each configuration "
           "timed once per round after a warm-up, rounds interleaved, medians reported.", "",
           "| TP x PP | ranks | threads (all ranks) | tokens/s (each round) | vs first row | TTFT p50 ms | TPOT p50 ms | "
           "greedy = first row |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['tp']} x {r['pp']} | {r['tp'] * r['pp']} | {r['threads']} | {r['tokens_per_s']:.1f} "
                   f"({', '.join(f'{x:.0f}' for x in r['rounds_tokens_per_s'])}) | "
                   f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['ttft_p50_ms']:.0f} | "
                   f"{r['tpot_p50_ms']:.1f} | {'yes' if r['token_ids'] == base['token_ids'] else 'NO'} |")
    out += ["", "## What the ranks sent and where their time went", "",
            "| TP x PP | micro-batches | all-reduced B / token (rank 0) | formula (2 x layers + 1) x hidden x 4 B | "
            "B / token / layer | "
            "all-reduce ms / step | forward ms / step (all-reduces included) | bubble (m = pp in flight) | bubble, one in flight "
            "(wall s: one vs m in flight) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "micro_batches" not in r:
            continue
        bubble = f"{r['bubble']:.0%} (formula {r['bubble_formula']:.0%})" if "bubble" in r else "-"
        one = (f"{r['bubble_one_in_flight']:.0%} ({r['seconds_one_in_flight']:.1f} s vs {r['seconds']:.1f} s)"
               if "bubble" in r else "-")
        out.append(f"| {r['tp']} x {r['pp']} | {r['micro_batches']} | {r['allreduce_bytes_per_token']:,.0f} | "
                   f"{r['formula_bytes_per_token']:,} | {r['allreduce_bytes_per_token_layer']:,.0f} | "
                   f"{r['allreduce_ms_per_step']:.1f} | {r['forward_ms_per_step']:.1f} | {bubble} | {one} |")
    out += ["", "Rank 0 holds stage 0: its layers' two all-reduces each (after o_proj and down_proj) and the "
            "vocab-parallel embedding's one; B / token / layer spreads all of it over the stage's layers, so "
            "it sits a little above 2 x hidden x 4 bytes. All-reduce time includes waiting for the slower "
            "rank. Throughput and latency are medians over the rounds; the other columns come from the last "
            "round.", "", "How to read it:", "", *reading(rows), "",
            "## The same arithmetic on real GPUs", "",
            "Llama-3-70B (80 layers, hidden 8192, bfloat16) at TP 8, one decode step of 64 sequences: "
            "160 all-reduces of 64 x 8192 x 2 bytes, against each GPU reading its eighth of the weights "
            "from HBM (H100, 3.35 TB/s). `llmopt.distributed.cost_model` holds the formulas.", "",
            "| link | all-reduce ms / step | weight read ms / step | share of the step in communication |",
            "|---|---|---|---|"]
    for g in gpu_table():
        out.append(f"| {g['link']} | {g['comm_ms']:.2f} | {g['weights_ms']:.2f} | {g['comm_share']:.0%} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--configs", nargs="+", default=["1x1:1", "1x1:2", "2x1:2", "1x2:2", "2x2:2"],
                   help="TPxPP:threads (torch threads of the whole run, split among the ranks); the first "
                        "is the baseline")
    p.add_argument("--repeat", type=int, default=2,
                   help="rounds; the configurations run interleaved, every other round in reverse order")
    p.add_argument("--out", default=None, help="markdown table (default: print)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from llmopt.model.config import ModelConfig
    from llmopt.model.registry import resolve_model

    vocab = ModelConfig.from_pretrained(resolve_model(args.model)).vocab_size
    prompts, params = workload(args.requests, args.max_tokens, vocab)
    engine = dict(num_kv_blocks=1024, max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False)
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    load_before = os.getloadavg()[0]
    for round_ in range(args.repeat):
        for c in args.configs if round_ % 2 == 0 else args.configs[::-1]:
            shape, _, threads = c.partition(":")
            tp, pp = map(int, shape.split("x"))
            runs[c].append(run_config(args.model, tp, pp, int(threads or 1), prompts, params, engine))
            print(f"round {round_}: TP {tp} x PP {pp}, {threads or 1} threads: "
                  f"{runs[c][-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    rows = []
    for c in args.configs:
        row = dict(runs[c][-1])
        for key in ("tokens_per_s", "ttft_p50_ms", "tpot_p50_ms"):
            row[key] = statistics.median(r[key] for r in runs[c])
        row["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in runs[c]]
        rows.append(row)
    text = markdown(args.model, rows, args, (load_before, os.getloadavg()[0]))
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "load_average": [load_before, os.getloadavg()[0]], "rows": [
            {k: v for k, v in r.items() if k != "token_ids"} for r in rows], "gpu": gpu_table()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
