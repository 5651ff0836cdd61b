"""Lesson 03's exercise: one scheduling step with a token budget, as the engine's Scheduler takes it.

Given what each running request still needs computed (1 for a decode, more for a prompt being
prefilled in chunks) and the prompt lengths waiting in the queue, the learner returns how many
new tokens each request gets this step. The check runs the engine's real `Scheduler` (with
memory to spare, so no preemption) on the same requests; the live run puts the learner's
function beside the scheduler of a running engine and compares them at every step.
"""

from __future__ import annotations

from llmopt.engine.block_manager import BlockManager
from llmopt.engine.scheduler import Scheduler
from llmopt.exercises.base import Case, Exercise
from llmopt.sampling_params import SamplingParams
from llmopt.sequence import Sequence, SequenceStatus


def schedule_step_solution(running: list[int], waiting: list[int], token_budget: int, max_num_seqs: int,
                           chunked_prefill: bool = True) -> list[int]:
    """New tokens per request this step: running requests first, then waiting ones, in order."""
    granted, budget = [], token_budget
    for need in running:                     # running requests go first, in order
        n = min(need, budget)
        granted.append(n)
        budget -= n
    num_seqs = len(running)
    stopped = False
    for prompt in waiting:                   # then the queue, from its head, while it can
        n = 0
        if not stopped and budget > 0 and num_seqs < max_num_seqs:
            n = prompt if prompt <= budget else (budget if chunked_prefill else 0)
        stopped = stopped or n == 0           # first come, first served: nobody passes the head
        granted.append(n)
        budget -= n
        num_seqs += n > 0
    return granted


def engine_schedule(running: list[int], waiting: list[int], token_budget: int, max_num_seqs: int,
                    chunked_prefill: bool = True) -> list[int]:
    """What the engine's Scheduler gives the same requests (enough KV blocks for everyone)."""
    bm = BlockManager(num_blocks=4096, block_size=16, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs, token_budget, chunked_prefill)
    seqs = []
    for i, need in enumerate(running):   # computed 8 tokens so far, `need` still to go
        seq = Sequence(f"r{i}", None, [1] * (8 + need), SamplingParams(max_tokens=4))
        sched.add(seq)              # (its arrival order), then straight to running
        sched.waiting.remove(seq)
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 8
        bm.allocate(seq.request_id, 8)
        sched.running.append(seq)
        seqs.append(seq)
    for j, prompt in enumerate(waiting):
        seq = Sequence(f"w{j}", None, [1] * prompt, SamplingParams(max_tokens=4))
        sched.add(seq)
        seqs.append(seq)
    got = {s.request_id: n for s, n in sched.schedule().scheduled}
    return [got.get(s.request_id, 0) for s in seqs]


# (running, waiting, token_budget, max_num_seqs, chunked_prefill)
STEPS = [([1, 1, 1], [], 8, 8, True), ([1, 1], [5], 8, 8, True), ([1, 1], [10], 8, 8, True),
         ([1], [3, 4, 2], 8, 8, True), ([], [20, 3], 16, 8, True), ([1, 1], [10, 2], 8, 8, False),
         ([6, 1], [4], 5, 8, True), ([1, 1, 1], [2, 2], 64, 4, True), ([1] * 4, [3], 4, 8, True),
         ([], [8, 8, 8], 16, 2, True), ([3], [], 2, 8, False), ([], [4, 30, 1], 32, 8, False)]


def cases():
    for running, waiting, budget, max_seqs, chunked in STEPS:
        args = (running, waiting, budget, max_seqs, chunked)
        yield Case({"running": running, "waiting": waiting, "token_budget": budget, "max_num_seqs": max_seqs,
                    "chunked_prefill": chunked}, engine_schedule(*args),
                   lambda fn, a=args: list(fn(list(a[0]), list(a[1]), *a[2:])))


def live(fn) -> str:
    """`tiny` serving 6 requests of different prompt lengths with a 24-token budget and at most 4
    requests at once: before every step, `fn` predicts from the scheduler's queues what the step
    will compute, and the step the engine's scheduler then takes is compared with it."""
    from llmopt import LLM

    llm = LLM("tiny", device="cpu", max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=False,
              num_kv_blocks=128, enforce_eager=True)
    engine, sched = llm.llm_engine, llm.llm_engine.scheduler
    ids = llm.tokenizer("def fibonacci(n):\n    " * 8)["input_ids"]
    for i, n in enumerate([5, 40, 12, 3, 30, 9]):
        engine.add_request(f"req{i}", {"prompt_token_ids": ids[:n]}, SamplingParams(temperature=0.0, max_tokens=6,
                                                                                     ignore_eos=True))
    steps = agreed = 0
    first_diff = ""
    while engine.has_unfinished_requests():
        order = list(sched.running) + list(sched.waiting)
        predicted = fn([s.num_tokens - s.num_computed_tokens for s in sched.running],
                       [s.num_tokens - s.num_computed_tokens for s in sched.waiting],
                       sched.max_num_batched_tokens, sched.max_num_seqs, sched.chunked)
        before = {s.request_id: s.num_computed_tokens for s in order}
        engine.step()
        taken = [s.num_computed_tokens - before[s.request_id] for s in order]
        steps += 1
        if list(predicted) == taken:
            agreed += 1
        elif not first_diff:
            first_diff = f"\nfirst difference, step {steps}: you gave {list(predicted)}, the scheduler {taken}"
    return f"{agreed} of {steps} steps of the live engine scheduled exactly as your function said{first_diff}"


EXERCISE = Exercise("token_budget_schedule", 3, "split one step's token budget between running and waiting requests",
                    cases, schedule_step_solution, live)
