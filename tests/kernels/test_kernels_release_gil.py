"""The CPU kernels let go of the GIL while they run (llmopt/kernels/cpu/bindings.cpp), as torch's own
ops do: the server's event loop streams tokens while its engine thread is inside a step, and a
notebook's client reads while a prefill runs beside it."""

import sys
import threading

import torch

from llmopt.kernels import cpu


def other_thread_ran_during(call) -> bool:
    """Whether this thread got to run Python while `call` ran in another thread. The switch interval
    is set far longer than the call, so the only way in before `call` returns is its letting go of
    the GIL."""
    entering, done, seen = threading.Event(), threading.Event(), []

    def run():
        entering.set()
        call()
        done.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        entering.wait()
        seen.append(not done.is_set())
        thread.join()
    finally:
        sys.setswitchinterval(before)
    return seen[0]


def busy_python(turns: int = 2_000_000) -> None:
    total = 0
    for i in range(turns):
        total += i


def test_a_kernel_call_leaves_the_gil_to_other_threads():
    ops = cpu.load()
    x, w = torch.randn(4, 4096, dtype=torch.bfloat16), torch.randn(8192, 4096, dtype=torch.bfloat16)  # the row kernel
    assert not other_thread_ran_during(busy_python)  # the check can fail: Python work keeps the GIL
    assert other_thread_ran_during(lambda: [ops.dense_matmul(x, w) for _ in range(5)])
