"""Several micro-batches in flight: how pipeline parallelism keeps every stage busy.

One engine step with a pipeline of `pp` stages would leave all stages but one idle. So the
engine keeps up to `pp` micro-batches in flight, each scheduled from the sequences that are
not already in one (a sequence needs its last token back before its next step): while
stage 1 runs micro-batch A, stage 0 runs B. vLLM gets the same effect from
`pipeline_parallel_size` virtual engines, each with its own scheduler; here one scheduler
takes turns, so the KV pool and the prefix cache stay shared.

Each call of `pipelined_step` tops the pipeline up, then waits for the oldest micro-batch
and does its bookkeeping, so the engine's outputs come in the order they were scheduled.
"""

from __future__ import annotations


def pipelined_step(engine) -> list:
    from llmopt.distributed.executor import deferred_interrupt

    with deferred_interrupt():  # what is in flight must stay in step with the workers
        return _pipelined_step(engine)


def _pipelined_step(engine) -> list:
    executor, runner = engine.executor, engine.runner
    while len(executor.in_flight) < executor.max_in_flight:
        busy = {seq.request_id for sched, _ in executor.in_flight for seq, _ in sched.scheduled}
        sched, hits_before = _schedule_excluding(engine, busy)
        if not sched.scheduled:
            break
        runner.submit(sched.scheduled)
        executor.in_flight.append((sched, hits_before))
    if not executor.in_flight:
        return []
    sched, hits_before = executor.in_flight.popleft()
    sampled = runner.collect()
    # a request aborted while its micro-batch was in flight is already gone from the engine
    sched.scheduled = [(seq, n) for seq, n in sched.scheduled if not seq.is_finished]
    return engine._process(sched, sampled, {}, hits_before)


def _schedule_excluding(engine, busy: set[str]):
    """Schedule as usual, as if the sequences in flight were not running (so they are neither
    given more tokens nor preempted); they keep their places in the running list."""
    sch = engine.scheduler
    everyone, limit = sch.running, sch.max_num_seqs
    in_flight = [s for s in everyone if s.request_id in busy]
    sch.running = [s for s in everyone if s.request_id not in busy]
    sch.max_num_seqs = limit - len(in_flight)  # they still count against max_num_seqs
    try:
        return engine._schedule()
    finally:
        still = {id(s) for s in sch.running}
        before = {id(s) for s in everyone}
        sch.running = ([s for s in everyone if s.request_id in busy or id(s) in still]
                       + [s for s in sch.running if id(s) not in before])
        sch.max_num_seqs = limit
