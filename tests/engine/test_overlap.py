"""The overlap scheduler (llmopt/engine/overlap.py, async_scheduling=True): step n+1 queued before
step n is read, and every request gets the tokens it gets without it, through endings the host
cannot foresee (stop tokens), endings it can (max_tokens), arrivals, aborts and preemptions."""

import dataclasses

import pytest

from llmopt import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:", "x = [", "for i in range(10):",
           "# sort a list\n" * 3]
KW = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=8)


def params(stops=()):
    out = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17, 30, 12, 21)]
    out[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    out[4] = SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=25, ignore_eos=True)
    for i, token in stops:  # ends the host learns of only when it reads the step's tokens
        out[i] = dataclasses.replace(out[i], stop_token_ids=[token])
    return out


def run(llm, ps):
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, ps, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny", **KW)


@pytest.fixture(scope="module")
def overlapped():
    return LLM("tiny", async_scheduling=True, **KW)


def test_same_tokens_as_plain_steps(plain, overlapped):
    want = run(plain, params())
    assert run(overlapped, params()) == want
    assert overlapped.llm_engine.overlap.overlapped > 20  # steps really were queued behind others
    assert overlapped.llm_engine.overlap.pending is None  # nothing left in flight after generate
    # stop tokens the host cannot foresee: the rows queued after them are dropped
    ends = [(1, want[1][4]), (3, want[3][10]), (5, want[5][2])]
    want_stopped = run(plain, params(ends))
    assert [len(t) for t in want_stopped] != [len(t) for t in want]
    assert run(overlapped, params(ends)) == want_stopped
    overlapped.llm_engine.block_manager.check_invariants()


def test_arrivals_aborts_and_preemption():
    want_llm = LLM("tiny", **{**KW, "num_kv_blocks": 12})
    llm = LLM("tiny", async_scheduling=True, **{**KW, "num_kv_blocks": 12})
    outs = {}
    for engine in (want_llm.llm_engine, llm.llm_engine):
        got = {}
        ps = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in PROMPTS]
        for i in range(3):
            engine.add_request(str(i), PROMPTS[i], ps[i])
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
            steps += 1
            if steps == 6:  # arrivals while decoding is overlapped
                for i in range(3, 6):
                    engine.add_request(str(i), PROMPTS[i], ps[i])
            if steps == 14:
                engine.abort_request("1")
        engine.block_manager.check_invariants()
        outs[engine is llm.llm_engine] = got
    assert llm.llm_engine.overlap.overlapped > 0
    assert llm.llm_engine.scheduler.num_preemptions > 0  # 12 blocks of 16 cannot hold six sequences
    # request 1 was aborted at the same step() call; its streamed tokens run a step behind with the
    # overlap (a step's outputs come back from the call after it), so they are a prefix
    aborted = [outs[k].pop("1")[0] for k in (False, True)]
    assert aborted[1] == aborted[0][:len(aborted[1])] and len(aborted[1]) > 0
    assert outs[True] == outs[False]


def test_refused_with_drafts_and_pipelines():
    with pytest.raises(ValueError, match="async_scheduling=True .*speculative_config"):
        LLM("tiny", async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(TypeError, match="async_scheduling must be True or False"):
        LLM("tiny", async_scheduling="yes")
