"""Where the browser suite finds the lessons, the browser and its artifacts folder, and whether it can run."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LESSONS_DIR = REPO / "lessons"

# Screenshots, reports and logs of each run (CI keeps this folder as an artifact; README names it).
ARTIFACTS = Path(os.environ.get("LLMOPT_BROWSER_ARTIFACTS", REPO / "browser-artifacts"))


def lessons() -> list[Path]:
    """Every lesson notebook, found by name, so new lessons are covered without a change here."""
    return sorted(LESSONS_DIR.glob("[0-9][0-9]_*.ipynb"))


def chromium() -> str | None:
    for candidate in (os.environ.get("LLMOPT_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


def unavailable() -> str | None:
    """Why the browser suite cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "Playwright is not installed (pip install -c constraints.txt -e '.[dev]')"
    if chromium() is None:
        return "no Chromium found (apt-get install chromium, or set LLMOPT_CHROMIUM)"
    return None
