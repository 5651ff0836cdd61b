"""lessons/README.md's table of wall time, CPU time and peak memory, from a browser-suite run.

The browser suite (tests/browser) runs every lesson from the wheel in a fresh venv, as a learner
does, and writes one report per lesson to browser-artifacts/<worker>/NN_name.txt. This prints the
table's rows from those reports, with the machine and its load, for lessons/README.md:

    python -m pytest --nbval tests/browser/test_browser_lessons.py lessons -k in_browser
    python scripts/lesson_table.py [browser-artifacts]
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def report_values(text: str) -> dict:
    """The run's seconds, the kernel's CPU seconds and the peak memory from one report."""
    first = text.splitlines()[0]
    seconds = ast.literal_eval(first[first.index("{"):first.index("}") + 1])
    cpu = ast.literal_eval(re.search(r"CPU seconds (\{.*\})", text).group(1))
    memory = ast.literal_eval(re.search(r"peak memory of the kernel and its processes, GB (\{.*\})", text).group(1))
    return {"run s": seconds["run"], "kernel CPU s": cpu["kernel"], "peak GB": memory["pss"]}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{cpu}, {os.cpu_count()} cores, {isa} (the lessons pin AVX2), load average {os.getloadavg()[0]:.2f} now"


def main() -> int:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "browser-artifacts"
    reports = sorted(folder.glob("*/[0-9][0-9]_*.txt"))
    if not reports:
        print(f"no lesson reports under {folder}; run the browser suite first", file=sys.stderr)
        return 1
    print(f"measured on: {machine()}\n")
    print("| # | lesson | wall time | kernel CPU time | peak memory |")
    print("|---|---|---|---|---|")
    for path in reports:
        v = report_values(path.read_text())
        wall = f"{v['run s']:.0f} s" if v["run s"] < 100 else f"{v['run s'] / 60:.1f} min"
        print(f"| {path.stem[:2]} | {path.stem[3:]} | {wall} | {v['kernel CPU s']:.0f} s | {v['peak GB']:.2f} GB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
