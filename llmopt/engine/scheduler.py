"""The scheduler: which requests run in the next step, and how many tokens each.

Continuous batching as vLLM's V1 scheduler does it. There is no separate "prefill
phase": every step has one token budget (`max_num_batched_tokens`), and each scheduled
request gets some tokens of it: a decode gets 1, a prompt gets as many as remain (or,
with chunked prefill, as many as fit, the rest in later steps). Requests join and
leave the batch between any two steps.

1. Running requests go first, in order. When the block pool cannot hold a request's
   new tokens, the scheduler preempts (frees the KV of) the request that should yield
   (the newest under "fcfs", the lowest priority under "priority"), which goes back
   to the queue and later recomputes what it lost.
2. Waiting requests are then admitted while budget, `max_num_seqs` and blocks allow,
   starting from what the prefix cache already holds. Under "priority", a waiting
   request may preempt a running one of lower priority (larger value). Under "lpm" the
   queue is first sorted by cached prefix length, longest first (SGLang's policy).

With pipeline parallelism several steps are in flight at once (`max_in_flight` > 1): a
request whose step has not come back yet is skipped, neither given tokens nor preempted
(it needs its last token before its next step), and still counts against `max_num_seqs`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmopt.engine.block_manager import BlockManager
from llmopt.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    prefix_hits_before: int = 0  # the prefix cache's hit count when this step was scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs", max_in_flight: int = 1):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = 0
        self.max_in_flight = max_in_flight
        self.in_flight: set[str] = set()  # request ids of steps scheduled and not yet finished

    # -- queue -----------------------------------------------------------------------------
    def _rank(self, seq: Sequence) -> tuple:
        """Smaller = served first. fcfs: arrival order; priority: (priority, arrival order)."""
        if self.policy == "priority":
            return (seq.priority, seq.arrival_order)
        return (seq.arrival_order,)

    def add(self, seq: Sequence) -> None:
        seq.arrival_order = self._arrivals
        self._arrivals += 1
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Keep the queue in serving order: by rank under "priority"; under "fcfs" new
        arrivals go to the back and preempted requests (which arrived earlier) to the front."""
        if self.policy == "priority":
            rank = self._rank(seq)
            at = next((i for i, w in enumerate(self.waiting) if self._rank(w) > rank), len(self.waiting))
            self.waiting.insert(at, seq)
        elif seq.status == SequenceStatus.PREEMPTED:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.in_flight.discard(seq.request_id)
        self.bm.free(seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_step(self, out: SchedulerOutput) -> None:
        """The step `out` came back: its requests may be scheduled again."""
        self.in_flight.difference_update(seq.request_id for seq, _ in out.scheduled)

    def allocate_lookahead(self, seq: Sequence, num_tokens: int) -> bool:
        """Slots for `num_tokens` speculative tokens after `seq`'s last (vLLM's lookahead
        slots), where a draft model writes its KV; False when the pool is short."""
        return self.bm.allocate(seq.request_id, len(seq) + num_tokens)

    # -- one step -------------------------------------------------------------------------------
    def _idle(self) -> list[Sequence]:
        """Running requests whose last step has come back (all of them, one step at a time)."""
        return [s for s in self.running if s.request_id not in self.in_flight]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":
            self.running.sort(key=self._rank)

        # 1. running requests: decodes, and prompts still being prefilled in chunks
        idle = self._idle() if self.in_flight else list(self.running)  # pipelined: not those in flight
        i = 0
        while i < len(idle) and budget > 0:
            seq = idle[i]
            if seq.spec_token_ids and 1 + len(seq.spec_token_ids) > budget:
                seq.clear_drafts()  # no room to verify guesses this step
            n = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq.request_id, seq.num_computed_tokens + n):
                victim = idle.pop()  # newest (fcfs) / lowest priority (sorted above)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:  # it preempted itself
                break
            out.scheduled.append((seq, n))
            budget -= n
            i += 1

        # 2. waiting requests, if nothing had to be preempted for memory this step
        if self.policy == "lpm" and len(self.waiting) > 1 and budget > 0 and not out.preempted:
            self._sort_longest_prefix_first()
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs and not self._preempt_for(seq, out):
                break
            cached = []
            if seq.num_computed_tokens == 0:
                cached = self.bm.find_cached_prefix(seq.request_id, seq.token_ids)
            computed = self.bm.num_cached_tokens(cached)
            n = seq.num_tokens - computed
            if n > budget:
                if not self.chunked:
                    break  # without chunking a prompt runs whole or waits
                n = budget
            while not self.bm.allocate(seq.request_id, computed + n, cached):
                if not self._preempt_for(seq, out):
                    break
            else:
                self.waiting.popleft()
                if seq.status == SequenceStatus.WAITING:  # first admission (not a resume)
                    seq.num_cached_tokens = computed
                self.bm.record_prefix_query(seq.num_tokens, computed)
                seq.num_computed_tokens = computed
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append((seq, n))
                budget -= n
                continue
            break
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if self.max_in_flight > 1:
            self.in_flight.update(seq.request_id for seq, _ in out.scheduled)
        return out

    def _sort_longest_prefix_first(self) -> None:
        """SGLang's "lpm": the waiting request with the longest cached prefix goes first (ties in
        arrival order), so requests that share a prefix run while it is cached, before other
        requests' blocks evict it. Looked up again every step: the cache changes as requests run."""
        cached = {id(s): self.bm.cached_prefix_len(s.token_ids) for s in self.waiting}
        self.waiting = deque(sorted(self.waiting, key=lambda s: (-cached[id(s)], s.arrival_order)))

    def _preempt_for(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Priority policy: a waiting request may push out a running one it outranks."""
        idle = self._idle()
        if self.policy != "priority" or not idle:
            return False
        victim = max(idle, key=self._rank)
        if self._rank(victim) <= self._rank(seq):
            return False
        self._preempt(victim, out)
        return True

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take back a request `out` scheduled (its offloaded blocks failed their check): it recomputes."""
        self._preempt(seq, out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop its KV; it re-enters the queue at the front."""
        self.running.remove(seq)
        self.bm.free(seq.request_id)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.clear_drafts()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        self._enqueue(seq)
