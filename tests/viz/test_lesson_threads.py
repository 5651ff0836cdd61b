"""A lesson's two-thread sections take the cores the notebook has, no more (llmopt.viz.lesson_threads)."""

import os

import pytest

from llmopt.viz import lesson_threads

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("asked, want, expected", [
    (None, 2, min(2, CORES)),      # nothing asked: what it wants, within this process's cores
    ("1", 2, 1),                   # OMP_NUM_THREADS=1, as on a machine shared with other work
    ("4", 2, min(2, CORES)),       # a larger cap does not add threads a section did not want
    ("0", 2, min(2, CORES)),       # not a count: ignored
    ("two", 2, min(2, CORES)),
    (None, 64, CORES),             # never more than the cores it may run on
    ("1", 0, 1),                   # at least one
])
def test_lesson_threads_keeps_to_the_cores_and_the_cap(monkeypatch, asked, want, expected):
    if asked is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", asked)
    assert lesson_threads(want) == expected


def test_lesson_threads_keeps_to_the_affinity(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert lesson_threads(2) == 1
