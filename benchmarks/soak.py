"""The long soak: two `llmopt serve` replicas (one speculative) behind the real nginx at ~80% of
their measured capacity for a few minutes, with faults: a replica killed and restarted (twice),
a client that stalls, an oversized and a malformed body, a replica drained and restarted.

    python benchmarks/soak.py [--duration 180]   # writes benchmarks/results/soak.{md,json}

Capacity is measured first, through nginx, as the request rate served with every client
sending at once. The table reports the accounting (accepted, answered, retried, refused with
503 + Retry-After, cut, lost silently), TTFT and TPOT per 10-second window, KV blocks and RSS
per replica over time, and the goals: 0 lost silently, 0 leaked blocks, RSS growth < 5% after
warm-up, p99 TTFT back within 10 s of each restart. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from llmopt.bench.common import percentile
from llmopt.bench.load import LoadRequest, LoadTest
from llmopt.bench.soak import Fault, Soak, summarize_soak
from llmopt.server.nginx import NginxProcess
from llmopt.server.process import ServerProcess, start_all

RESULTS = Path(__file__).parent / "results"
BASE = ["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "256", "--max-num-seqs", "6",
        "--max-waiting-requests", "6", "--shutdown-timeout", "60"]
SPEC = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']


def capacity(replica_args) -> float:
    servers = start_all([ServerProcess(a) for a in replica_args])
    try:
        with NginxProcess([s.url for s in servers]) as lb:
            reqs = [LoadRequest("def fibonacci(n):", 32) for _ in range(36)]
            s = LoadTest(lb.url, reqs, rate=float("inf"), model="tiny", max_retries=20,
                         metrics_url=servers[0].url).wait()
            return s["request_throughput"]
    finally:
        for s in servers:
            s.stop()


def rss_growth(samples: list[dict], warm_up: float = 0.3) -> dict[int, float]:
    """Per replica process: RSS at its end over RSS after the first `warm_up` share of its life."""
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for row in samples:
        if row.get("rss_mb"):
            by_pid.setdefault(row["pid"], []).append((row["time"], row["rss_mb"]))
    out = {}
    for pid, rows in by_pid.items():
        if len(rows) < 20:
            continue
        t0, t1 = rows[0][0], rows[-1][0]
        warm = next(r for t, r in rows if t >= t0 + warm_up * (t1 - t0))
        out[pid] = rows[-1][1] / warm - 1
    return out


def recovery(soak: Soak, summary: dict, probe: float = 5.0) -> list[float | None]:
    """Seconds after each restart's ready until requests sent from then on see a normal TTFT:
    the first whole second t >= 0 after ready at which the p99 TTFT of requests sent in
    [ready + t, ready + t + `probe`) is within 1.5x of the run's median window p99 (None: never
    before the next kill or drain, or the end). Requests sent while the replica was away are the outage's
    cost, not the recovery's: they are in the window table above, by send time."""
    quiet = [w["ttft_p99_ms"] for w in summary["windows"] if w["requests"] and w["ttft_p99_ms"] == w["ttft_p99_ms"]]
    normal = percentile(quiet, 50) / 1e3
    starts = sorted(f["at"] for f in summary["events"] if f["kind"] in ("kill", "drain"))  # not a stall
    out = []
    for e in summary["events"]:
        if e["kind"] not in ("kill", "drain"):
            continue
        until = next((t for t in starts if t > e["ready"]), soak.duration)
        back, t = None, 0.0
        while e["ready"] + t + probe <= until:
            ttft = [r.ttft for r in soak.records
                    if e["ready"] + t <= r.send_time < e["ready"] + t + probe and r.ttft is not None]
            if ttft and percentile(ttft, 99) <= 1.5 * normal:
                back = t
                break
            t += 1.0
        out.append(back)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--share", type=float, default=0.8, help="share of the measured capacity to offer")
    args = ap.parse_args()
    load = os.getloadavg()
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    replicas = [BASE, BASE + SPEC]
    cap = capacity(replicas)
    d = args.duration
    faults = [Fault(0.2 * d, "kill", 0), Fault(0.3 * d, "stall"), Fault(0.35 * d, "oversized"),
              Fault(0.38 * d, "malformed"), Fault(0.5 * d, "drain", 1), Fault(0.75 * d, "kill", 1)]
    started = time.time()
    soak = Soak(replicas, rate=args.share * cap, duration=d, faults=faults, seed=0)
    soak.run()
    window = 10.0
    s = summarize_soak(soak, window=window)
    s.update(capacity_req_s=cap, rate=args.share * cap, load_average=load, cpu=cpu, started=started,
             rss_growth=rss_growth(s["samples"]), ttft_recovery_s=recovery(soak, s))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(s, indent=1, default=str) + "\n")
    (RESULTS / "soak.md").write_text(table(s, d) + "\n")
    print(table(s, d))


def table(s: dict, duration: float) -> str:
    lines = [f"# Soak with faults: 2 tiny replicas (one n-gram speculative) behind nginx, {duration:.0f} s",
             "", f"CPU: {s['cpu']}; load average before the run: {', '.join(f'{x:.2f}' for x in s['load_average'])}; "
             f"measured capacity {s['capacity_req_s']:.2f} req/s, offered {s['rate']:.2f} req/s (Poisson, 60% "
             "streamed, 16-48 tokens)", "",
             "| accepted | answered | retried | refused 503 + Retry-After | 503s without Retry-After | cut streams | "
             "lost silently | leaked KV (replicas) |", "|---|---|---|---|---|---|---|---|",
             f"| {s['requests']} | {s['answered']} | {s['retried']} | {s['refused_503']} | "
             f"{s['answers_503_without_retry_after']} | {s['cut']} | {s['lost_silently']} | {len(s['leaked_kv'])} |",
             "", "Faults: " + "; ".join(f"{e['kind']} at {e['at']:.0f} s" + (
                 f" (replica {e['replica']}, exit {e['exit_code']}, ready again at {e['ready']:.0f} s)"
                 if "ready" in e else "") for e in s["events"])
             + "; probes: " + ", ".join(f"{p['kind']} -> {p['status']}" for p in s["probes"]), "",
             "RSS growth after warm-up, per replica process: " + ", ".join(
                 f"{g:+.1%}" for g in s["rss_growth"].values()) + " (goal < 5%)",
             "TTFT p99 back to normal after each restart (requests sent in 5 s from then, within 1.5x the "
             "median window's p99): " + ", ".join("never" if r is None else f"{r:.0f} s"
                                                  for r in s["ttft_recovery_s"]) + " (goal within 10 s)", "",
             "| window (s) | requests | answered | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
             "KV usage r0 / r1 | RSS MB r0 / r1 |", "|---|---|---|---|---|---|---|---|---|"]
    for w in s["windows"]:
        if not w["requests"]:
            continue
        inside = [x for x in s["samples"] if w["start"] <= x["time"] < w["start"] + 10.0]
        kv = [max((x.get("kv_usage", 0) for x in inside if x["replica"] == r), default=float("nan")) for r in (0, 1)]
        rss = [max((x["rss_mb"] or 0 for x in inside if x["replica"] == r), default=float("nan")) for r in (0, 1)]
        lines.append(f"| {w['start']:.0f} | {w['requests']} | {w['answered']} | {w['ttft_p50_ms']:.0f} | "
                     f"{w['ttft_p99_ms']:.0f} | {w['tpot_p50_ms']:.1f} | {w['tpot_p99_ms']:.1f} | "
                     f"{kv[0]:.0%} / {kv[1]:.0%} | {rss[0]:.0f} / {rss[1]:.0f} |")
    recovered = [r for r in s["ttft_recovery_s"] if r is not None]
    lines += ["", "Reading it: every accepted request was answered, refused with 503 + Retry-After after its "
              "retries, or (a stream that had started on a killed replica) ended with an error its client saw; "
              f"{s['lost_silently']} lost silently, {len(s['leaked_kv'])} replicas holding KV blocks at the end. "
              "While a replica is away the other carries the load (its window shows the queueing in TTFT); "
              "recovery counts from the restarted replica's ready, over requests sent from then on, at 1-second "
              "steps (10-second windows would round every recovery up to the window's end). "
              + (f"Here the slowest recovery took {max(recovered):.0f} s." if recovered else "")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
