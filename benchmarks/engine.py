"""The serving engine against its baselines: the four workloads of `llmopt bench`, in one go.

Runs `offline` (HF static batching vs one request at a time vs the engine), `kv-memory`,
`prefix` and `chunked` (see llmopt/bench/), prints each table, and writes them all to
benchmarks/results/engine.md, with the raw numbers (per-request tokens, TTFTs, per-step
KV shares...) in benchmarks/results/engine.json for lessons to plot.

    python benchmarks/engine.py                       # full sizes (the committed results)
    python benchmarks/engine.py --num-requests 8 --output-len 8 16 --out-dir /tmp/smoke
    python benchmarks/engine.py --workloads offline --batch-size 64

Any `llmopt bench` flag (sizes, engine flags) is passed on to every workload. Every section's
header gives the load average taken before the first workload started.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from llmopt.bench import for_json, run_workload
from llmopt.bench.common import load_average
from llmopt.cli import build_parser

ALL = ["offline", "kv-memory", "prefix", "chunked"]
TITLES = {
    "offline": "Offline throughput: HF static batching vs one request at a time vs the engine",
    "kv-memory": "KV memory: share of reserved slots that hold tokens",
    "prefix": "Prefix caching: shared system prompt",
    "chunked": "Chunked prefill: long prompts arriving while others decode",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=ALL, default=ALL)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ours, rest = ap.parse_known_args(argv)
    if "--profile-steps" not in rest:
        rest = ["--profile-steps", "10", *rest]  # the offline table comes with its profile
    command = shlex.join(["python", "benchmarks/engine.py", *argv])

    sections, raw = [], {"command": command, "load_average": load_average()}  # before any work
    t0 = time.perf_counter()
    for w in ours.workloads:
        args = build_parser().parse_args(["bench", "--workload", w, *rest])
        text, numbers = run_workload(args, command, raw["load_average"])
        print(f"\n## {TITLES[w]}\n\n{text}\n", flush=True)
        sections.append(f"## {TITLES[w]}\n\n{text}\n")
        raw[w] = for_json(numbers)
    raw["total_seconds"] = time.perf_counter() - t0

    ours.out_dir.mkdir(parents=True, exist_ok=True)
    (ours.out_dir / "engine.md").write_text(
        "# The serving engine against its baselines\n\n"
        f"`{command}` ({raw['total_seconds'] / 60:.1f} min in all). Absolute numbers move with the "
        "machine and its load; the ratios within one table are measured side by side.\n\n"
        + "\n".join(sections))
    (ours.out_dir / "engine.json").write_text(json.dumps(raw) + "\n")
    print(f"wrote {ours.out_dir / 'engine.md'} and engine.json "
          f"({raw['total_seconds'] / 60:.1f} min)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
