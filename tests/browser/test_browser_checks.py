"""A test of the browser suite itself: a notebook with broken widgets must fail it, fault by fault.

The notebook (broken_notebook.py) runs through the same check as every lesson, nbval's check on
the browser's run included, and the report must name each fault, and nothing about the one
healthy widget beside them.
"""

from __future__ import annotations

import pytest
from nbval.plugin import IPyNbFile

import broken_notebook
from lesson_check import check_notebook


@pytest.mark.slow
def test_broken_widgets_fail_the_suite(lab, browser, artifacts, request):
    assert lab.running_kernels() == [], "a kernel from an earlier test is still running"
    path = broken_notebook.write(lab.root / "broken_widgets.ipynb")
    items = list(IPyNbFile.from_parent(request.session, path=path).collect())  # nbval's own items
    report = check_notebook(browser, lab, path, artifacts, nbval_items=items, move_timeout_s=10)
    (artifacts / "broken_widgets.txt").write_text(report.summary() + "\n")
    print(report.summary())
    found = "\n".join(report.problems)
    missed = {fault: words for fault, words in broken_notebook.FAULTS.items() if words not in found}
    assert not missed, f"faults the suite did not report: {missed}\n{report.summary()}"
    assert "healthy" not in found, report.summary()
    assert any(m.startswith("healthy: moved slider 'n'") and "output changed: True" in m
               for m in report.moves), report.summary()
    assert lab.running_kernels() == [], "the notebook's kernel was not shut down"
