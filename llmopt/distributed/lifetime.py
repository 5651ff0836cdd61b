"""A parallel LLM's life in a notebook: one owner of torch.distributed, and dead ranks named.

torch.distributed has one default process group per process, so only one parallel LLM can
hold it at a time. A notebook re-runs `llm = LLM(..., tensor_parallel_size=2)` and builds the
new LLM while the old one is still bound to `llm`; rather than refusing, the new one closes the
old one first (its workers stop, its groups are destroyed) and says so. A process group that
something else initialized (the caller's own, torchrun's) is never touched.

A worker that dies (killed, out of memory) must not leave the driver waiting in a collective
or failing with a socket error: `dead_ranks` names each one and how it ended.
"""

from __future__ import annotations

import logging
import signal
import time
import weakref

import torch.distributed as dist

logger = logging.getLogger(__name__)

_owner: weakref.ref | None = None  # the executor whose workers hold this process's default group


def take_over_distributed(executor, describe: str) -> None:
    """Make `executor` the owner of torch.distributed in this process, closing the previous
    owner first if it is still open (`describe`: the new LLM, for the notice)."""
    global _owner
    previous = _owner() if _owner is not None else None
    if previous is not None and previous is not executor and not previous.closed:
        logger.warning("closing the previous parallel LLM (its workers stop) to start %s: one parallel LLM "
                       "per process holds torch.distributed; call llm.close() (or del llm) before building "
                       "another to avoid this notice", describe)
        previous.superseded = True
        previous.close()
    elif previous is None and dist.is_initialized():
        return  # someone else's group: init_groups refuses, naming the cause
    _owner = weakref.ref(executor)


def release_distributed(executor) -> None:
    global _owner
    if _owner is not None and _owner() in (executor, None):
        _owner = None


def dead_ranks(procs, wait: float = 0.0) -> list[str]:
    """'rank N (killed by SIGKILL)' for every worker process that has ended; waits up to `wait`
    seconds for one to show (a collective can fail a moment before the kernel reaps the rank)."""
    deadline = time.monotonic() + wait
    while True:
        gone = [(rank, p.poll()) for rank, p in enumerate(procs, start=1) if p.poll() is not None]
        if gone or time.monotonic() >= deadline:
            return [f"rank {rank} ({_how(code)})" for rank, code in gone]
        time.sleep(0.05)


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
