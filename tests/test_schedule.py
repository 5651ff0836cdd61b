"""tests/schedule.py: how the suite's files and lessons are shared between two xdist workers, checked
on xdist's own scheduler driven as its controller drives it (workers stood in for by recorders)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from browser.browser_env import lessons
from schedule import BROWSER_LESSONS, INSTALLS, LessonsBesideTheRest, lesson_seconds, lessons_queue


def test_every_lesson_has_its_time_in_the_lessons_readme():
    """The lessons' order comes from lessons/README.md's table: a lesson missing there would be run
    last, however long it takes."""
    seconds = lesson_seconds()
    assert set(seconds) == {p.stem for p in lessons()}
    assert all(s > 0 for s in seconds.values()), seconds


class Worker:
    """What the scheduler sees of a worker: its id, and the tests it was sent (indexes into its collection)."""

    def __init__(self, id: str):
        self.gateway = SimpleNamespace(id=id)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.extend(indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


@pytest.fixture(autouse=True)
def no_given_install(monkeypatch):
    monkeypatch.delenv("LLMOPT_LEARNER_PYTHON", raising=False)  # else the install counts as done


SECONDS = {"00_a": 40, "01_b": 300, "02_c": 60, "03_d": 500}
COLLECTION = ([f"{BROWSER_LESSONS}test_lesson_in_browser[{name}]" for name in SECONDS]
              + [f"tests/test_one.py::test_{i}" for i in range(4)]
              + [f"{INSTALLS}::test_binder", f"{INSTALLS}::test_colab"]
              + [f"tests/test_two.py::test_{i}" for i in range(3)])


def run(order: list[str], ready_after: int = 0) -> dict[str, list[str]]:
    """Drive the scheduler as xdist's controller does: both workers join and collect, the first
    batch is sent, then each worker finishes its tests in turn as `order` says (gw0, gw1, ...);
    the learner's install is done once `ready_after` tests have finished."""
    config = SimpleNamespace(getvalue=lambda name: {"tx": ["2*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=True),
                             _tmp_path_factory=SimpleNamespace(getbasetemp=lambda: Path("/nonexistent")))
    sched = LessonsBesideTheRest(config)
    assert sched.learner_ready() is False  # no install in that folder
    finished = [0]
    sched.learner_ready = lambda: finished[0] >= ready_after
    sched.seconds = SECONDS
    workers = {w: Worker(w) for w in ("gw1", "gw0")}  # gw1 ready first: the lessons still go to gw0
    for w in workers.values():
        sched.add_node(w)
    for w in workers.values():
        sched.add_node_collection(w, COLLECTION)
    sched.schedule()
    done = {w: 0 for w in workers}
    for w in order:
        worker = workers[w]
        if done[w] < len(worker.sent):
            sched.mark_test_complete(worker, worker.sent[done[w]])
            done[w] += 1
            finished[0] += 1
    assert sched.tests_finished
    return {w: [COLLECTION[i] for i in worker.sent] for w, worker in workers.items()}


def test_the_first_worker_takes_the_lessons_longest_first_and_the_installs_second():
    ran = run(["gw0", "gw1"] * 20)
    assert ran["gw0"][:3] == [f"{BROWSER_LESSONS}test_lesson_in_browser[03_d]", f"{INSTALLS}::test_binder",
                              f"{INSTALLS}::test_colab"]
    assert ran["gw1"][0].startswith("tests/test_one.py::")  # the rest, in xdist's order (most tests first)
    assert sorted(ran["gw0"] + ran["gw1"]) == sorted(COLLECTION)  # each test once


def test_a_worker_with_nothing_left_takes_the_other_queues_front():
    ran = run(["gw1"] * 20 + ["gw0"] * 20)  # gw0 stays in its first lesson while gw1 works
    lessons_on_gw1 = [t for t in ran["gw1"] if t.startswith(BROWSER_LESSONS)]
    assert lessons_on_gw1, ran  # it took lessons once its own files were done
    assert ran["gw1"].index(lessons_on_gw1[0]) > ran["gw1"].index("tests/test_two.py::test_2")
    # longest first, on either worker: 01_b (300 s) before 02_c (60 s) before 00_a (40 s)
    order = [t for t in ran["gw0"] + ran["gw1"] if t.startswith(BROWSER_LESSONS)]
    assert order[0].endswith("[03_d]")
    assert [t[-5:-1] for t in lessons_on_gw1] == sorted((t[-5:-1] for t in lessons_on_gw1),
                                                        key=lambda name: -SECONDS[name])


def test_lessons_queue_orders_by_time_and_puts_a_missing_lesson_last():
    scopes = [f"{BROWSER_LESSONS}t[{n}]" for n in ("00_a", "09_new", "03_d", "01_b")] + [INSTALLS, "tests/x.py"]
    lessons = [f"{BROWSER_LESSONS}t[{n}]" for n in ("03_d", "01_b", "00_a", "09_new")]
    assert lessons_queue(scopes, SECONDS, first_lesson_sent=False) == lessons[:1] + [INSTALLS] + lessons[1:]
    assert lessons_queue(scopes, SECONDS, first_lesson_sent=True) == [INSTALLS] + lessons


def test_the_lessons_worker_takes_other_files_until_the_learners_install_is_done():
    ran = run(["gw0", "gw1"] * 20, ready_after=3)
    lessons_at = [i for i, t in enumerate(ran["gw0"]) if t.startswith(BROWSER_LESSONS)]
    assert not ran["gw0"][0].startswith(BROWSER_LESSONS)  # its first unit was sent before the install was done
    assert lessons_at and ran["gw0"][lessons_at[0]].endswith("[03_d]")  # then the longest lesson first
    assert sorted(ran["gw0"] + ran["gw1"]) == sorted(COLLECTION)
