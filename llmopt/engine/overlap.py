"""The overlap scheduler: the host prepares step n+1 while the GPU runs step n.

Without it a decode step is strictly host, then device, then host: schedule, build the step's
inputs, launch, wait for the tokens, append them, check stops, and only then schedule the
next. With a recorded step (llmopt/worker/cuda_graphs.py) the GPU part of a small model's step
is well under a millisecond, and the host's part is as long: the GPU waits half the time.
SGLang's overlap scheduler (vLLM's async scheduling) keeps it busy: step n+1 is queued behind
step n before step n's tokens are read, its input tokens taken from step n's output on the
device; then the host reads step n's tokens and does their bookkeeping while step n+1 runs.

    step() k:    queue n+1 (inputs: n's tokens, on the device)  |  read n's tokens, append, stop checks
    GPU:         ...... n ......|...... n+1 ......

What the host cannot know when it queues step n+1 is whether step n ended a sequence (EOS, a
stop string). Such a sequence's row in n+1 is wasted work: its token is dropped, and the KV it
writes goes to the slot after the sequence's last token, in a block that is freed with it and
that the stream has finished writing before any later step can reuse it. An ending the host can
foresee (max_tokens, max_model_len) leaves that sequence out of n+1. So every request gets the
tokens it gets without the overlap: greedy and seeded requests the same tokens (the tests hold
this), unseeded ones draws from the same distributions (they share the engine's generator,
whose draws depend on the batch anyway).

Only steady decoding is overlapped: the same sequences decoding one token each (the runner's
`decodes_on_device`: no drafts, grammars, log-probabilities, min_tokens), nothing waiting to be
admitted, a slot free for each. Anything else (a prompt, a new request, a preemption) drains:
step n is read and processed first and the scheduler plans the next step as always.
"""

from __future__ import annotations

from llmopt.engine.scheduler import SchedulerOutput
from llmopt.worker.model_runner import DeviceStep


class OverlapLoop:
    """`step()` in place of LLMEngine.step's body (after constrained admissions): returns the
    outputs of the step that finished, which is one behind the step just queued. The engine
    hands over the three phases of its plain step: `schedule()` -> SchedulerOutput,
    `execute(scheduled)` -> (sampled, errors), `process(sched, sampled, errors)` -> outputs."""

    def __init__(self, engine, schedule, execute, process):
        self.engine = engine
        self.schedule, self.execute, self.process = schedule, execute, process
        self.pending: tuple[SchedulerOutput, DeviceStep] | None = None  # queued, not yet read
        self.overlapped = 0  # steps queued behind another before it was read (tests, benchmarks)

    def step(self) -> list:
        e = self.engine
        if self.pending is None:
            sched = self.schedule()
            if not e.runner.decodes_on_device(sched.scheduled):  # a prompt, drafts, ...: the plain step
                return self.process(sched, *self.execute(sched.scheduled))
            try:
                self.pending = (sched, e.runner.launch([s for s, _ in sched.scheduled], e.block_manager.block_tables))
            except Exception:  # noqa: BLE001 - the plain step retries request by request (who failed, alone)
                return self.process(sched, *self.execute(sched.scheduled))
            return []
        sched, launched = self.pending
        self.pending = None
        nxt = self._next(sched)
        if nxt is not None:
            try:
                self.pending = (nxt, e.runner.launch([s for s, _ in nxt.scheduled], e.block_manager.block_tables,
                                                     after=launched))
                self.overlapped += 1
            except Exception:  # noqa: BLE001 - nothing queued: the next step() plans it plainly
                self.pending = None
        sched.scheduled = [(s, n) for s, n in sched.scheduled if not s.is_finished]  # aborted meanwhile
        try:
            sampled = launched.sampled()
        except Exception:  # noqa: BLE001 - rerun the step the plain way, request by request
            self.pending = None
            return self.process(sched, *self.execute(sched.scheduled))
        outputs = self.process(sched, sampled, {})
        if self.pending is not None:  # rows of sequences step n ended: their tokens are dropped
            nxt.scheduled = [(s, n) for s, n in nxt.scheduled if not s.is_finished]
            if not nxt.scheduled:
                self.pending = None
        return outputs

    def _next(self, sched: SchedulerOutput) -> SchedulerOutput | None:
        """Step n+1 planned before step n's tokens are known, or None (drain; the module's note):
        each sequence of step n that may go on decodes the token step n samples for it."""
        e = self.engine
        sch, bm = e.scheduler, e.block_manager
        seqs = [s for s, _ in sched.scheduled if not s.is_finished]
        if sch.waiting or e.structured.pending or not seqs or len(sch.running) != len(seqs):
            return None
        go_on = [s for s in seqs if s.num_tokens + 1 < e.max_model_len  # (Sequence.check_stop's length ends)
                 and (s.params.max_tokens is None or len(s.output_token_ids) + 1 < s.params.max_tokens)]
        if not go_on:
            return None
        bm.step_allocated, bm.step_freed = [], []
        for seq in go_on:  # the slot of the token step n samples: position num_tokens
            if not bm.allocate(seq.request_id, seq.num_tokens + 1):
                return None  # the pool is short: drain, and let the scheduler preempt
        return SchedulerOutput([(s, 1) for s in go_on], num_batched_tokens=len(go_on),
                               prefix_hits_before=bm.prefix_hits)
