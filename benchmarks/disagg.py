"""Disaggregated prefill and decode on SmolLM2 (bfloat16): what long prompts arriving do to the
decodes already running.

Three setups under one load, each its own servers on loopback (`llmopt serve`, `llmopt router`):
  - decode alone: the decode server (1 thread) with `--decodes` requests decoding and no prompt
    arriving: the baseline;
  - disaggregated: a prefill server (1 thread) and that decode server (1 thread) behind the router,
    the same decodes and, meanwhile, `--prompts` prompts of `--prompt-tokens` held-out tokens
    arriving (Poisson, `--rate` a second); each prompt is prefilled on its own server and only its
    last partial block is computed where the decodes run;
  - colocated: one server of 2 threads with chunked prefill (`--budget` tokens a step), the same
    decodes and prompts.
Measured from the streamed tokens: the running decodes' time per output token (the gaps between
their tokens: p50 and p99), the p99 as a multiple of the baseline's; the arriving prompts' TTFT.

    python benchmarks/disagg.py [--decodes 8] [--prompts 6] [--prompt-tokens 1500]

Writes results/disagg_smollm2.md and .json with the machine and the load average at the start.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from llmopt.bench.common import load_average, machine, percentile, table, write_result
from llmopt.bench.inputs import cut, heldout_tokens
from llmopt.bench.load import LoadRequest, LoadTest
from llmopt.model.loader import load_tokenizer
from llmopt.model.registry import resolve_model
from llmopt.server.process import RouterProcess, ServerProcess

MODEL = ["--model", "smollm2", "--dtype", "bfloat16", "--max-num-seqs", "16", "--num-kv-blocks", "1024"]


def role(kind: str, folder: str) -> list[str]:
    return ["--kv-transfer-config", '{"kv_connector": "SharedMemoryConnector", "kv_role": "%s", '
            '"kv_connector_extra_config": {"path": "%s"}}' % (kind, folder)]


def run(url: str, decodes: list[LoadRequest], prompts: list[LoadRequest], rate: float) -> dict:
    """The decodes all sent at once, the prompts arriving meanwhile; the decodes' token gaps and the
    prompts' TTFTs."""
    running = LoadTest(url, decodes, rate=1000.0, seed=1, timeout=900).start()
    arriving = LoadTest(url, prompts, rate=rate, seed=2, timeout=900).start() if prompts else None
    running.wait()
    if arriving is not None:
        arriving.wait()
    gaps = [g for r in running.results for g in r.itls[1:]]  # from the second token: decode only
    assert all(r.ok for r in running.results), [r.error for r in running.results if not r.ok]
    return {"tpot_p50_s": percentile(gaps, 50), "tpot_p99_s": percentile(gaps, 99), "gaps": len(gaps),
            "prompt_ttft_mean_s": (sum(r.ttft for r in arriving.results) / len(arriving.results)
                                   if arriving is not None else None)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=0.5, help="prompts a second (Poisson)")
    ap.add_argument("--budget", type=int, default=256, help="the colocated engine's tokens a step")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "disagg_smollm2"))
    args = ap.parse_args(argv)
    load = load_average()
    stream = heldout_tokens(load_tokenizer(resolve_model("smollm2")))
    rng = random.Random(0)
    decodes = [LoadRequest(cut(stream, 64, rng), args.decode_tokens) for _ in range(args.decodes)]
    prompts = [LoadRequest(cut(stream, args.prompt_tokens, rng), 16) for _ in range(args.prompts)]
    rows = {}
    folder = tempfile.mkdtemp(prefix="llmopt-transfer-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    with ServerProcess(MODEL + role("kv_consumer", folder)) as dec:
        rows["decode alone (1 thread)"] = run(dec.url, decodes, [], args.rate)
        with ServerProcess(MODEL + role("kv_producer", folder)) as pre, RouterProcess(pre.url, dec.url) as router:
            rows["disaggregated (1 + 1 threads)"] = run(router.url, decodes, prompts, args.rate)
    with ServerProcess(MODEL + ["--max-num-batched-tokens", str(args.budget)], threads=2) as one:
        rows["colocated, chunked prefill (2 threads)"] = run(one.url, decodes, prompts, args.rate)
    base = rows["decode alone (1 thread)"]["tpot_p99_s"]
    for r in rows.values():
        r["tpot_p99_vs_alone"] = r["tpot_p99_s"] / base
    command = "python benchmarks/disagg.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = ["setup", "decode TPOT p50 (ms)", "p99 (ms)", "p99 vs decode alone", "arriving prompts' TTFT (s)"]
    body = [[name, f"{1000 * r['tpot_p50_s']:.1f}", f"{1000 * r['tpot_p99_s']:.1f}", f"{r['tpot_p99_vs_alone']:.2f}x",
             "-" if r["prompt_ttft_mean_s"] is None else f"{r['prompt_ttft_mean_s']:.2f}"] for name, r in rows.items()]
    text = (f"# Disaggregated prefill and decode, SmolLM2-135M-Instruct, bfloat16\n\n"
            f"Machine: {machine()}; load average {load:.2f} at the start. Command: `{command.strip()}`.\n"
            f"Load: {args.decodes} requests decoding {args.decode_tokens} tokens each (64-token prompts), and meanwhile "
            f"{args.prompts} prompts of {args.prompt_tokens} held-out tokens arriving at {args.rate} a second "
            f"(16 tokens each); the colocated server's budget {args.budget} tokens a step.\n\n" + table(head, body) + "\n")
    write_result(args.out, text, load, [{"setup": name, **r} for name, r in rows.items()])


if __name__ == "__main__":
    main()
