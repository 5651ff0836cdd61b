"""The files llmopt ships besides its code: the deployment files and the committed benchmark tables.

A learner runs the lessons from an installed package (a wheel on Colab, Binder or a laptop), not
from a clone, so everything a lesson or `llmopt serve`'s helpers read is package data, found with
`importlib.resources` whether llmopt is installed from a wheel or edited in place:

    llmopt/data/deploy   -> the repository's deploy/ (nginx.conf, docker-compose.yml, Grafana, ...)
    llmopt/data/results  -> the repository's benchmarks/results/ (the tables lessons quote)

Both are symbolic links into the checkout, so each file is written once and the repository's
deploy/ stays where compose expects it; building the wheel copies the linked files into it
(pyproject.toml's package-data names them).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DATA_DIR = Path(str(files("llmopt") / "data"))
DEPLOY_DIR = DATA_DIR / "deploy"
RESULTS_DIR = DATA_DIR / "results"


def _shipped(folder: Path, name: str, what: str) -> Path:
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"{what} name must be a relative file name inside {folder.name}/, got {name!r}")
    path = folder / name
    if not path.is_file():
        known = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
        shipped = ", ".join(known) or "none: this install lacks its package data, reinstall llmopt"
        raise FileNotFoundError(f"llmopt ships no {what} {name!r} ({path}); shipped: {shipped}")
    return path


def deploy_file(name: str) -> Path:
    """A shipped deployment file by its path under deploy/ (`deploy_file("nginx.conf")`)."""
    return _shipped(DEPLOY_DIR, name, "deployment file")


def committed_result(name: str) -> Path:
    """A committed benchmark table by its name under benchmarks/results/ (`committed_result("spec.md")`)."""
    return _shipped(RESULTS_DIR, name, "benchmark result")
