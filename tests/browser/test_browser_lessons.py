"""Every lesson, run in JupyterLab in a real browser, draws and responds as a learner sees it.

One test per lesson (lessons/NN_*.ipynb, found by name), one kernel at a time, from the learner's
install (the wheel in a fresh venv, conftest.py). What is checked is listed in lesson_check.py; the
report of each lesson (times, counts, peak memory, every control moved) is printed and written to
the artifacts folder beside its screenshots.

Lessons that use a system tool when it is there (nginx and promtool in lesson 11) run once more
without it, as on Colab, Binder and most laptops, and must still run to their end. (Lesson 12 reads
llama.cpp's committed measurements and never runs llama.cpp, which CI does not build: its one run
is already without it.)
"""

from __future__ import annotations

import subprocess

import nbformat
import pytest
from browser_env import lessons
from lab_server import kernel_env
from lesson_check import check_notebook, output_problems

# How a lesson looks for its optional tools; LLMOPT_<TOOL>=none makes each one answer "not installed".
TOOL_FINDERS = {"find_nginx(": "LLMOPT_NGINX", "find_promtool(": "LLMOPT_PROMTOOL"}


def lessons_using_tools() -> list[str]:
    return [p.stem for p in lessons() if any(finder in p.read_text() for finder in TOOL_FINDERS)]


@pytest.mark.slow
@pytest.mark.parametrize("lesson", [p.stem for p in lessons()])
def test_lesson_in_browser(lesson, learner_lab, browser, artifacts, nbval_items):
    lab = learner_lab
    assert lab.running_kernels() == [], "a kernel from an earlier test is still running"
    report = check_notebook(browser, lab, lab.root / f"{lesson}.ipynb", artifacts,
                            nbval_items=nbval_items.get(lesson))
    (artifacts / f"{lesson}.txt").write_text(report.summary() + "\n")
    print(report.summary())
    assert lab.running_kernels() == [], "the lesson's kernel was not shut down"
    assert report.ran is not None and report.ran.widgets >= 1, "every lesson has at least one widget"
    assert not report.problems, "\n" + report.summary()


RUN_HEADLESS = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, kernel_name="python3", timeout=900, allow_errors=True,
               resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(nb, sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.parametrize("lesson", lessons_using_tools())
def test_lesson_runs_without_its_system_tools(lesson, learner_env, learner_lab, tmp_path, artifacts):
    assert learner_lab.running_kernels() == [], "a kernel from the browser run is still running"  # one at a time
    python, env = learner_env
    path = tmp_path / f"{lesson}.ipynb"
    path.write_text((lessons()[0].parent / f"{lesson}.ipynb").read_text())
    env = {**env, **kernel_env(), **{var: "none" for var in TOOL_FINDERS.values()}}
    subprocess.run([python, "-c", RUN_HEADLESS, str(path), str(tmp_path)], env=env, cwd=tmp_path,
                   check=True, timeout=1200)
    nb = nbformat.read(path, as_version=4)
    nbformat.write(nb, artifacts / f"{lesson}-without-tools.ipynb")
    problems = output_problems(nb)
    assert not problems, "\n".join(problems)
    said = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "not installed" in said, "the lesson never said that a tool was missing"
