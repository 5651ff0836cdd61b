"""How the suite is shared between pytest-xdist's two workers (`.ci/run`: `-n 2 --dist loadfile`).

xdist's loadfile sends whole test files to whichever worker asks next, the files with the most
tests first. The browser lessons are one file of 15 tests, but every lesson runs for minutes: about
half of the whole suite's time, so on one worker they were the run's length while the other worker
finished early and waited. Here each lesson is its own unit. The first worker starts on the
lessons, longest first (its wall time in lessons/README.md, which scripts/lesson_table.py writes
from a quiet run), and the second on every other file, in xdist's order; a worker whose own queue
is empty takes the front of the other's, so the two finish within about one lesson of each other.

The lessons' worker is also where the installs of a learner's environments start, as soon as its
tests are collected (tests/conftest.py): the wheel in a fresh venv that JupyterLab serves the lessons
from, then Binder's and Colab's (test_binder_colab.py), which is why that file is second in the
lessons' queue, after the longest lesson. Until the learner's install is done, the lessons' worker
takes other files too rather than wait for it. Placement changes only how long the run takes, never
a result: every fixture makes what it needs wherever its test lands.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

ROOT = Path(__file__).resolve().parents[1]
BROWSER_LESSONS = "tests/browser/test_browser_lessons.py::"
INSTALLS = "tests/test_binder_colab.py"
LESSONS_WORKER = "gw0"
LESSON_ROW = re.compile(r"^\| (\d\d) \| \[.*?\]\((\d\d_\w+)\.ipynb\).*?\| ([\d.]+) (s|min) \|", re.M)


def lesson_seconds(readme: Path = ROOT / "lessons" / "README.md") -> dict[str, float]:
    """lesson name (NN_title) -> its wall time in lessons/README.md's table, in seconds."""
    return {name: float(value) * (60 if unit == "min" else 1)
            for _, name, value, unit in LESSON_ROW.findall(readme.read_text())}


def lesson_of(scope: str) -> str | None:
    """The lesson a browser-suite test runs (its parameter), or None for any other test."""
    if not scope.startswith(BROWSER_LESSONS):
        return None
    return scope[scope.index("[") + 1:scope.rindex("]")]


def lessons_queue(scopes: list[str], seconds: dict[str, float], first_lesson_sent: bool) -> list[str]:
    """The lessons' worker's order: the longest lesson, the installs' file, the other lessons by
    length (a lesson missing from the table last)."""
    lessons = sorted((s for s in scopes if lesson_of(s)), key=lambda s: -seconds.get(lesson_of(s), 0.0))
    installs = [s for s in scopes if s == INSTALLS]
    return installs + lessons if first_lesson_sent else lessons[:1] + installs + lessons[1:]


def learner_install_done(config):
    """A check of whether the learner's install (tests/fresh_install.py) is there for the lessons:
    its mark in the run's shared folder, which is this controller's temporary folder."""
    if os.environ.get("LLMOPT_LEARNER_PYTHON"):  # an install given: nothing to wait for
        return lambda: True
    from fresh_install import run_dir

    return (run_dir(config) / "learner" / "installed").exists


class LessonsBesideTheRest(LoadFileScheduling):
    """loadfile, with each browser lesson a unit of its own and two queues (see the module's doc)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.seconds = lesson_seconds()
        self.first_lesson_sent = False
        self.learner_ready = learner_install_done(config)

    def _split_scope(self, nodeid: str) -> str:
        return nodeid if lesson_of(nodeid) else super()._split_scope(nodeid)

    def _assign_work_unit(self, node) -> None:
        scopes = list(self.workqueue)
        lessons = lessons_queue(scopes, self.seconds, self.first_lesson_sent)
        rest = [s for s in scopes if s not in lessons]
        # the lessons' worker takes other files until the learner's install is there: its lessons
        # would only wait for it (minutes of pip beside the other worker's tests)
        lessons_first = node.gateway.id == LESSONS_WORKER and self.learner_ready()
        home, other = (lessons, rest) if lessons_first else (rest, lessons)
        scope = (home or other)[0]
        self.first_lesson_sent |= lesson_of(scope) is not None
        self.workqueue.move_to_end(scope, last=False)  # the base class takes the front
        super()._assign_work_unit(node)
