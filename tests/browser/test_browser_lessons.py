"""Every lesson, run in JupyterLab in a real browser, draws and responds as a learner sees it.

One test per lesson (lessons/NN_*.ipynb, found by name), one kernel at a time. What is checked
is listed in lesson_check.py; the report of each lesson (times, counts, every control moved) is
printed and written to the artifacts folder beside its screenshots.
"""

from __future__ import annotations

import pytest
from browser_env import lessons
from lesson_check import check_notebook


@pytest.mark.slow
@pytest.mark.parametrize("lesson", [p.stem for p in lessons()])
def test_lesson_in_browser(lesson, lab, browser, artifacts, nbval_items):
    assert lab.running_kernels() == [], "a kernel from an earlier test is still running"
    report = check_notebook(browser, lab, lab.root / f"{lesson}.ipynb", artifacts,
                            nbval_items=nbval_items.get(lesson))
    (artifacts / f"{lesson}.txt").write_text(report.summary() + "\n")
    print(report.summary())
    assert lab.running_kernels() == [], "the lesson's kernel was not shut down"
    assert report.ran is not None and report.ran.widgets >= 1, "every lesson has at least one widget"
    assert not report.problems, "\n" + report.summary()
