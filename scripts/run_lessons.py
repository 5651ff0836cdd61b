"""Regenerate the stored outputs of the lesson notebooks, headlessly and the same way every time.

Each notebook runs top to bottom in a fresh `python3` kernel (the interpreter running this
script), from the lessons/ folder, with hash seeds and the plotly renderer fixed, and is
written back in place. nbval then compares a fresh run against these stored outputs, so
outputs are never edited by hand: change a notebook's code, run this, commit both.

    python scripts/run_lessons.py                       # every lessons/*.ipynb
    python scripts/run_lessons.py lessons/01_kv_cache.ipynb
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
KERNEL = "python3"
MAX_BYTES = 1_000_000
# Signs of plotly.js embedded in an output (the "notebook" or "iframe" renderers), which would
# put megabytes into the file: figures must be stored as plotly's JSON mimetype only.
EMBEDDED_PLOTLY = ("window.PlotlyConfig", "plotly-latest", "cdn.plot.ly")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

KERNEL_ENV = {
    "PYTHONHASHSEED": "0",                 # set/dict orders inside the kernel are the same every run
    "PLOTLY_RENDERER": "plotly_mimetype",  # llmopt.viz.setup_notebook() picks the same
    "HF_HUB_OFFLINE": "1",                 # lessons run offline
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    # The same float32 arithmetic on every x86 machine. Left to itself, each library picks the
    # widest vector unit the CPU has (AVX-512 on one machine, AVX2 on the next), and the last
    # bits of a sum change with it: a perplexity's third decimal, one draw in 20,000 of a
    # sampling experiment. Pinned to AVX2 (which every x86 CI machine has) and two threads (the
    # CI machine's cores; a reduction split over more threads adds in another order), a fresh
    # run prints what is stored. A learner's own kernel is not affected.
    "ATEN_CPU_CAPABILITY": "avx2",   # PyTorch's own vectorized kernels
    "MKL_CBWR": "AVX2,STRICT",       # MKL's matrix products: same code path, any thread count
    "ONEDNN_MAX_CPU_ISA": "AVX2",    # oneDNN (bfloat16 and some float32 matmuls)
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
}


def run(path: Path, timeout: int, slowest: int = 5) -> float:
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3 (ipykernel)", "language": "python"}
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=timeout, record_timing=True,
                            store_widget_state=False, resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    # The slowest cells, printed (where a lesson's time goes), then dropped: timestamps in the
    # file would change on every run.
    took = []
    for i, cell in enumerate(nb.cells):
        stamps = cell.get("metadata", {}).pop("execution", None)
        if stamps and "shell.execute_reply" in stamps and "iopub.execute_input" in stamps:
            took.append((_seconds(stamps["shell.execute_reply"]) - _seconds(stamps["iopub.execute_input"]), i))
    for s, i in sorted(took, reverse=True)[:slowest]:
        print(f"  cell {i}: {s:.1f} s", flush=True)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            # A stored widget view points at a kernel-side model that no longer exists; keep only
            # its text form, which says to run the notebook (nbval never compares the view anyway).
            out.get("data", {}).pop(WIDGET_VIEW, None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return seconds


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def check(path: Path) -> list[str]:
    text = path.read_text()
    problems = [f"embeds plotly.js ({s!r})" for s in EMBEDDED_PLOTLY if s in text]
    if len(text.encode()) > MAX_BYTES:
        problems.append(f"is {len(text.encode()):,} bytes; the limit is {MAX_BYTES:,}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every lessons/*.ipynb")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell")
    args = parser.parse_args()
    os.environ.update(KERNEL_ENV)  # the kernel inherits this process's environment
    paths = [p.resolve() for p in args.notebooks] or sorted(LESSONS.glob("*.ipynb"))
    failed = False
    for path in paths:
        print(f"{path.name}: running...", flush=True)
        seconds = run(path, args.timeout)
        problems = check(path)
        size = path.stat().st_size
        print(f"{path.name}: {seconds:.0f} s, {size / 1e3:,.0f} kB" + (
            "" if not problems else "; " + "; ".join(problems)), flush=True)
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
