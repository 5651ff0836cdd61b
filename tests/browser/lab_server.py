"""A JupyterLab server on loopback, started the way a learner starts one, for the browser tests.

It serves a scratch copy of the notebooks (JupyterLab saves what it runs, and the stored
lesson outputs belong to scripts/run_lessons.py), with its own settings, workspace and
runtime folders so that nothing on the machine changes what the browser sees. It runs from the
Python it is given (the suite gives the learner's install: llmopt's wheel in a fresh venv, see
tests/fresh_install.py), so JupyterLab, its extensions and the kernels are that install's. Kernels
get the environment scripts/run_lessons.py gives them. The app object is exposed in the page
(`window.jupyterapp`) so the suite can read each notebook's model and kernel state; widgets
and cells are still driven through the page, as a learner would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from browser_env import REPO


def kernel_env() -> dict[str, str]:
    """The kernels' environment: the one scripts/run_lessons.py regenerates stored outputs with."""
    spec = importlib.util.spec_from_file_location("run_lessons", REPO / "scripts" / "run_lessons.py")
    run_lessons = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_lessons)
    return dict(run_lessons.KERNEL_ENV)


def shared_machine_env() -> dict[str, str]:
    """On one of pytest-xdist's workers the lessons' kernels share the cores with the other worker's
    tests: OMP_NUM_THREADS gives them the worker's share, which a lesson's two-thread sections keep to
    (llmopt.viz.lesson_threads). Two threads on a core another process is using make every parallel
    region wait for the descheduled one: a lesson took three to four times as long so in CI. Alone
    (one process, or a lesson's outputs regenerated), nothing is set and a lesson takes what it asks."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return {}
    share = str(max(1, len(os.sched_getaffinity(0)) // workers))
    return {"OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share}   # MKL's own count, set by run_lessons' env


# User settings JupyterLab reads at start (a learner's defaults except where noted).
SETTINGS = {
    # Every cell stays in the page, so that every output can be counted and seen; JupyterLab's
    # default draws only the cells near the viewport.
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    # No "would you like to receive news?" dialog over the first notebook.
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    # No autosave: the check saves the scratch copy itself before shutting the kernel down, and an
    # autosave timer (120 s after the first change) firing during that save puts two writes of one
    # notebook in flight; the server's atomic write shares one intermediate file between them, and
    # the loser answered 500 (a CI run failed on lesson 07, whose run lasts about 120 s).
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`with JupyterLab(root) as lab:` serves `root` at `lab.url(path)` until the block ends."""

    def __init__(self, root: Path, log: Path, python: str | Path = sys.executable, env: dict | None = None,
                 startup_timeout: float = 120.0):
        self.python, self.base_env = str(python), dict(os.environ if env is None else env)
        self.root = Path(root).resolve()
        self.log_path = Path(log).resolve()
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def lab_url(self, notebook: str) -> str:
        return self.url(f"lab/tree/{notebook}?token={self.token}&reset")

    def __enter__(self) -> "JupyterLab":
        home = self.log_path.parent / f"{self.log_path.stem}-home"  # one per server: two may run at once
        shutil.rmtree(home, ignore_errors=True)
        settings = home / "settings"
        for plugin, values in SETTINGS.items():
            path = settings / (plugin + ".jupyterlab-settings")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        # No input history in the lessons' kernels: IPython's history thread, meeting the sqlite file
        # another kernel left locked, prints "The history saving thread hit an unexpected error
        # (... readonly database)" to stdout in whatever cell is running (two CI runs failed on it).
        # No list of workspaces: its model polls GET /lab/api/workspaces, which reads every saved
        # workspace file while the page's layout saves (PUT) rewrite its own in place (truncate, then
        # write), and a read between the two is a JSON error the server answers with 500 (a CI run
        # failed on lesson 07 so). The layout is still saved; only the list and its menus are gone.
        labconfig = home / "config" / "labconfig"
        labconfig.mkdir(parents=True, exist_ok=True)
        (labconfig / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {"@jupyterlab/workspaces-extension": True}}))
        profile = home / "ipython" / "profile_default"
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "ipython_kernel_config.py").write_text("c.HistoryManager.enabled = False\n")
        env = {**self.base_env, **kernel_env(), **shared_machine_env(),
               "JUPYTER_CONFIG_DIR": str(home / "config"),
               "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
               "IPYTHONDIR": str(home / "ipython")}
        cmd = [self.python, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
               "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={self.root}",
               f"--LabApp.user_settings_dir={settings}",
               f"--LabApp.workspaces_dir={home / 'workspaces'}",
               "--LabApp.expose_app_in_browser=True",
               "--LabApp.news_url=",  # nothing is fetched from outside loopback
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:  # CI runs as root, which JupyterLab refuses unless told
            cmd.append("--allow-root")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}; "
                                   f"its log:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url(f"api/status?token={self.token}"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"JupyterLab did not answer on port {self.port} within "
                           f"{self.startup_timeout:.0f} s; its log:\n{self.log_path.read_text()[-3000:]}")

    def running_kernels(self) -> list[dict]:
        with urllib.request.urlopen(self.url(f"api/kernels?token={self.token}"), timeout=10) as r:
            return json.load(r)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # the server shuts its kernels down on SIGTERM
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()
