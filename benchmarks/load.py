"""Serving under load: Poisson arrivals at several rates against `llmopt serve`, prefix caching on vs off.

Starts the server as a child process (prefix caching on, then off; every other engine flag
the same), sends the same requests at each rate (a shared system prompt of held-out code,
then a distinct part; streamed; greedy, ignore_eos), and reports per rate: TTFT and TPOT
p50 / p90 / p99, output throughput, the offered and served request rates, peak KV usage,
and the rate at which the server saturates (llmopt/bench/load.py). Writes
benchmarks/results/load.md and load.json.

    python benchmarks/load.py                                             # the committed results
    python benchmarks/load.py --request-rate 2 8 --num-requests 16 --out-dir /tmp/smoke

Other flags go to `llmopt serve` (e.g. --max-num-seqs 32, --threads 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from llmopt.bench import cpu_name
from llmopt.bench.load import LoadTest, bench_requests, load_table, run_sweep, saturation_line, saturation_rate
from llmopt.server.process import ServerProcess

CONFIGS = {"prefix caching on": ["--enable-prefix-caching"], "prefix caching off": ["--no-enable-prefix-caching"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--request-rate", type=float, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--num-requests", type=int, default=64, help="per rate")
    ap.add_argument("--prefix-len", type=int, default=512, help="shared system prompt tokens")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64], help="distinct tokens per request")
    ap.add_argument("--output-len", type=int, nargs=2, default=[64, 64])
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--workload-seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ours, server_flags = ap.parse_known_args(argv)
    command = shlex.join(["python", "benchmarks/load.py", *argv])
    requests = bench_requests("tiny", ours.num_requests, ours.prefix_len, tuple(ours.prompt_len),
                              tuple(ours.output_len), ours.workload_seed)
    warm = requests[:4]

    t0, raw, sections = time.perf_counter(), {"command": command, "loadavg_start": os.getloadavg()}, []
    for name, flags in CONFIGS.items():
        args = ["--model", "tiny", "--device", "cpu", *flags, *server_flags]
        with ServerProcess(args, threads=ours.threads) as server:
            LoadTest(server.url, warm, float("inf")).wait()  # first-request costs out of the measurement
            summaries = run_sweep(server.url, requests, ours.request_rate, seed=ours.workload_seed,
                                  progress=ours.progress)
        raw[name] = {"server_flags": args, "runs": summaries}
        text = f"### {name}\n\n`llmopt serve {shlex.join(args)} --threads {ours.threads}`\n\n" + load_table(
            summaries) + "\n\n" + saturation_line(summaries) + "\n"
        print("\n" + text, flush=True)
        sections.append(text)
    raw["total_seconds"] = time.perf_counter() - t0
    raw["loadavg_end"] = os.getloadavg()

    on, off = raw["prefix caching on"]["runs"], raw["prefix caching off"]["runs"]
    rows = ["| rate (req/s) | TTFT p50 ms on / off | off / on | TTFT p90 ms on / off | TPOT p50 ms on / off "
            "| output tok/s on / off | on / off |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(on, off):
        rows.append(f"| {a['rate']:g} | {a['ttft_p50_ms']:,.1f} / {b['ttft_p50_ms']:,.1f} | "
                    f"{b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x | {a['ttft_p90_ms']:,.1f} / {b['ttft_p90_ms']:,.1f} | "
                    f"{a['tpot_p50_ms']:,.1f} / {b['tpot_p50_ms']:,.1f} | "
                    f"{a['output_throughput']:,.0f} / {b['output_throughput']:,.0f} | "
                    f"{a['output_throughput'] / b['output_throughput']:.2f}x |")
    sat = {k: saturation_rate(raw[k]["runs"]) for k in CONFIGS}
    head = (f"model `tiny`, {torch.float32}, cpu, torch {torch.__version__}, server threads {ours.threads}, "
            f"{cpu_name()} ({os.cpu_count()} cores, shared with the load generator and other work: load average "
            f"{raw['loadavg_start'][0]:.1f} at the start, {raw['loadavg_end'][0]:.1f} at the end), Python "
            f"{platform.python_version()}; command: `{command}`")
    workload = (f"{ours.num_requests} requests per rate, Poisson arrivals (seed {ours.workload_seed}); each prompt "
                f"is a shared {ours.prefix_len}-token system prompt + {ours.prompt_len[0]}-{ours.prompt_len[1]} "
                f"distinct tokens of held-out code; {ours.output_len[0]}-{ours.output_len[1]} output tokens "
                "(greedy, ignore_eos), streamed over HTTP with `stream_options.include_usage`.")
    text = (
        "# Serving under load: `llmopt serve` at several request rates\n\n"
        f"`{command}` ({raw['total_seconds'] / 60:.1f} min in all). {head}\n\n{workload}\n\n"
        "TTFT: request sent to first text chunk; TPOT: (last chunk - first chunk) / (output tokens - 1); "
        "offered: the arrivals' rate, (n - 1) / (last send - first send); served: n / (last finish - first send); "
        "saturated: served below 90% of the offered rate; saturation: the most requests/s served at any rate (the "
        "server's capacity). Absolute numbers move with the machine and its load; read the ratios.\n\n"
        "## Prefix caching on vs off, side by side\n\n" + "\n".join(rows) + "\n\n"
        f"Saturation: prefix caching on: {_rate(sat['prefix caching on'])}; off: {_rate(sat['prefix caching off'])}.\n\n"
        "## Per rate\n\n" + "\n".join(sections))
    ours.out_dir.mkdir(parents=True, exist_ok=True)
    (ours.out_dir / "load.md").write_text(text)
    (ours.out_dir / "load.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"\nwrote {ours.out_dir / 'load.md'} and load.json ({raw['total_seconds'] / 60:.1f} min)")
    return 0


def _rate(r: float | None) -> str:
    return "not reached at the rates tried" if r is None else f"about {r:.2f} req/s"


if __name__ == "__main__":
    sys.exit(main())
