"""CPU seconds used by the processes a browser test runs, by kind, to tell what a lesson costs CI.

Wall time on a shared 2-core machine says little; CPU seconds of the kernel (the lesson's own
work, which nbval would spend too) against those of JupyterLab's server and Chromium (what the
browser adds) do. Processes are found among this process's descendants by their command line.
"""

from __future__ import annotations

import os

import psutil

KINDS = (("kernel", "ipykernel_launcher"), ("jupyter server", "jupyterlab"), ("chromium", "chrom"))


def cpu_seconds() -> dict[str, float]:
    totals = {kind: 0.0 for kind, _ in KINDS}
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            t = proc.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        for kind, marker in KINDS:
            if marker in cmd:
                totals[kind] += t.user + t.system
                break
    return totals


def since(before: dict[str, float]) -> dict[str, float]:
    now = cpu_seconds()
    return {kind: round(now[kind] - before.get(kind, 0.0), 1) for kind in now}
