"""The peak memory of a lesson as a container counts it: the notebook's kernel and every process it
starts (servers, parallel workers), summed, sampled through the run.

Binder gives the whole container about 2 GB. A container's memory counts each page once, so the
sum is of PSS (proportional set size: a page shared by n processes counts 1/n in each), not of RSS,
which would count the torch libraries a kernel and its server processes share once per process.
RSS summed is reported beside it as the upper bound.
"""

from __future__ import annotations

import threading

import psutil

KERNEL_MARKER = "ipykernel_launcher"


def kernel_tree(root_pid: int) -> list[psutil.Process]:
    """The kernels among `root_pid`'s descendants (JupyterLab's server starts them) and all their
    descendants."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if KERNEL_MARKER in " ".join(proc.cmdline()):
                found[proc.pid] = proc
                found.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.Error:  # exited meanwhile
            continue
    return list(found.values())


class PeakMemory:
    """`with PeakMemory(lab_pid) as m: ...` then `m.peak_pss`, `m.peak_rss` (bytes): the largest sum
    over the kernel tree seen in samples every `interval` seconds."""

    def __init__(self, root_pid: int, interval: float = 0.5):
        self.root_pid, self.interval = root_pid, interval
        self.peak_pss = self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            pss = rss = 0
            for proc in kernel_tree(self.root_pid):
                try:
                    info = proc.memory_full_info()
                except psutil.Error:
                    continue
                pss, rss = pss + info.pss, rss + info.rss
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)

    def start(self) -> "PeakMemory":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "PeakMemory":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
