"""Fixtures of the browser suite: one JupyterLab server and one headless Chromium per test session.

The suite needs Playwright's Python package (the `dev` extra) and a Chromium on the machine
(Debian: `apt-get install chromium`; another one: LLMOPT_CHROMIUM=/path/to/chrome). Without
them its tests are skipped, and nbval checks the lessons on its own, as before; with CI set they
fail instead, so that CI cannot pass without having looked at the lessons in a browser.

The lessons run as a learner runs them: JupyterLab and its kernels come from llmopt's wheel,
built from this checkout and installed with its lessons extra in a fresh virtual environment
(tests/fresh_install.py), and serve a copy of the lessons in an empty folder outside the
repository, offline. LLMOPT_LEARNER_PYTHON=/path/to/venv/bin/python reuses such an install.

When the suite runs a lesson and nbval was asked for (`pytest --nbval`), nbval's items for that
notebook are taken out of the run and their check is made on the browser's run of the lesson
(see nbval_in_browser.py), so each lesson runs once.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite's modules, imported by name

from browser_env import ARTIFACTS, LESSONS_DIR, chromium, lessons, unavailable  # noqa: E402

NBVAL_ITEMS = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items):
    """Take nbval's items of each lesson the browser suite will run out of the run (see above)."""
    if unavailable():
        return
    in_browser = {item.callspec.params["lesson"] for item in items
                  if item.nodeid.startswith("tests/browser/test_browser_lessons.py::") and hasattr(item, "callspec")}
    moved: dict[str, list] = {}
    kept = []
    for item in items:
        path = Path(str(getattr(item, "fspath", "")))
        if type(item).__name__ == "IPyNbCell" and path.parent == LESSONS_DIR and path.stem in in_browser:
            moved.setdefault(path.stem, []).append(item)
        else:
            kept.append(item)
    if moved:
        config.stash[NBVAL_ITEMS] = moved
        config.hook.pytest_deselected(items=[i for group in moved.values() for i in group])
        items[:] = kept


@pytest.fixture(scope="session")
def nbval_items(request) -> dict:
    """lesson name -> nbval's items for it, when nbval was asked for and the browser runs it."""
    return request.config.stash.get(NBVAL_ITEMS, {})


@pytest.fixture(scope="session")
def artifacts() -> Path:
    # one folder per test process: JupyterLab keeps its home and runtime files here, and when two
    # xdist workers cleared one shared folder, one deleted the other's running lab's (which then
    # answered 500 to every new session) or lost the race to create it (FileExistsError)
    path = ARTIFACTS / os.environ.get("PYTEST_XDIST_WORKER", "main")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def available() -> None:
    reason = unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"the browser suite must run in CI: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def learner_env(request) -> tuple[Path, dict]:
    """(python, environment) of the learner's install: the wheel in a fresh venv, one for the run
    (tests/conftest.py starts it before the first lesson asks; every xdist worker uses it)."""
    from fresh_install import run_dir, shared_learner_env, venv_env

    available()
    reuse = os.environ.get("LLMOPT_LEARNER_PYTHON")
    if reuse:
        return Path(reuse), venv_env(Path(reuse).parent.parent)
    return shared_learner_env(run_dir(request.config))


def serve_lessons(tmp_path_factory, artifacts: Path, name: str, python=sys.executable, env=None):
    """JupyterLab from `python`'s environment, serving a scratch copy of the lessons in an empty
    folder (tests add their own notebooks there); its log and home go to artifacts/<name>*."""
    from lab_server import JupyterLab

    root = tmp_path_factory.mktemp(f"{name}-root")
    for path in lessons():
        shutil.copy(path, root / path.name)
    return JupyterLab(root, log=artifacts / f"{name}.log", python=python, env=env)


# Session-wide, like the artifacts folder: on two workers the lessons come one at a time between
# other files (tests/schedule.py), and fixtures scoped to this folder were torn down at every such
# switch, restarting JupyterLab and Chromium and clearing the folder of the reports made so far.
@pytest.fixture(scope="session")
def learner_lab(tmp_path_factory, artifacts, learner_env):
    """The lessons' JupyterLab: the learner's install (the wheel in a fresh venv)."""
    python, env = learner_env
    with serve_lessons(tmp_path_factory, artifacts, "jupyterlab-learner", python, env) as server:
        yield server


@pytest.fixture(scope="session")
def lab(tmp_path_factory, artifacts):
    """JupyterLab from this environment, for the suite's checks of itself (broken_notebook.py),
    which test the check rather than the learner's install and so need no wheel built."""
    available()
    with serve_lessons(tmp_path_factory, artifacts, "jupyterlab") as server:
        yield server


@pytest.fixture(scope="session")
def browser():
    available()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox cannot start;
        # --disable-dev-shm-usage: containers often give /dev/shm too little room for its tabs
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()
