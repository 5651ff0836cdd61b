"""Where a lesson's memory goes: each cell's peak, summed over the kernel and every process it starts.

Runs each notebook top to bottom as scripts/run_lessons.py does (same kernel environment; outputs
are not written back) while a thread samples the kernel's process tree, and prints the cells whose
peak is highest. The sum is of PSS, as a container counts memory (tests/browser/tree_memory.py says
why); the browser suite reports the same sum for a whole lesson.

    python scripts/lesson_memory.py lessons/08_serving.ipynb [--top 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from run_lessons import KERNEL, KERNEL_ENV  # noqa: E402


def tree_pss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:
            continue
    return total


def profile(path: Path, timeout: int) -> list[tuple[int, int, str]]:
    """(peak PSS bytes, cell index, first line) for every code cell of `path`."""
    nb = nbformat.read(path, as_version=4)
    current, peaks, stop = [-1], {}, threading.Event()
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=timeout, resources={"metadata": {"path": str(path.parent)}},
                            on_cell_start=lambda cell, cell_index: current.__setitem__(0, cell_index))

    def sample():
        while not stop.wait(0.25):
            proc = getattr(getattr(client.km, "provisioner", None), "process", None)
            if proc is not None:
                peaks[current[0]] = max(peaks.get(current[0], 0), tree_pss(proc.pid))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        client.execute()
    finally:
        stop.set()
        thread.join()
    return sorted(((peak, i, nb.cells[i].source.strip().splitlines()[0][:70] if i >= 0 and nb.cells[i].source.strip()
                    else "") for i, peak in peaks.items()), reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=8, help="cells to print per lesson")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell")
    args = parser.parse_args()
    os.environ.update(KERNEL_ENV)
    for path in args.notebooks:
        rows = profile(path.resolve(), args.timeout)
        print(f"{path.name}: peak {rows[0][0] / 1e9:.2f} GB (PSS, kernel and its processes)")
        for peak, i, line in rows[:args.top]:
            print(f"  cell {i:3d}  {peak / 1e9:5.2f} GB  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
