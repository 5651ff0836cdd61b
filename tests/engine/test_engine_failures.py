"""A request that breaks a step fails alone, and a failed or interrupted `generate()` leaves
nothing behind.

The failures are injected where a real one would surface (sampling raising for one request,
a proposer raising, Ctrl-C in the middle of a step); the engine must then finish that request
with finish_reason "error", keep every other request's tokens exactly as without it, free
every block, and serve the next call as if nothing had happened.
"""

import pytest

from llmopt import LLM, SamplingParams
from llmopt.layers import sampler_cpu

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
POISON = SamplingParams(temperature=1.0, seed=13, max_tokens=8)  # seed 13 marks the request to break
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n"]


class Injected(Exception):
    pass


@pytest.fixture
def poisoned_sampling(monkeypatch):
    """Sampling raises whenever the poison request is among the rows, as a bad parameter would
    (the engine's sampler, llmopt/layers/sampler_cpu.py, which the default backend draws with)."""
    real = sampler_cpu.sample

    def sample(logits, params, generators):
        if any(p.seed == 13 for p in params):
            raise Injected("sampling failed for the poison request")
        return real(logits, params, generators)

    monkeypatch.setattr(sampler_cpu, "sample", sample)


def assert_clean(llm):
    engine = llm.llm_engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.get_metrics()["kv_cache_usage_perc"] == 0.0
    engine.block_manager.check_invariants()


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_tiny_temperature_is_greedy_and_the_engine_goes_on(tiny_llm):
    """temperature=1e-40 passed validation and made float32 logits inf/NaN: every later call failed."""
    ref = tiny_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=1e-40, max_tokens=8), use_tqdm=False)
    assert texts(out) == texts(ref)
    assert texts(tiny_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)) == texts(ref)
    assert_clean(tiny_llm)


def test_a_request_whose_step_raises_fails_alone(tiny_llm, poisoned_sampling):
    engine = tiny_llm.llm_engine
    refs = [o.outputs[0] for o in tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    failed_before = engine.get_metrics()["num_failed"]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"good-{i}", prompt, GREEDY)
    engine.add_request("poison", PROMPTS[0], POISON)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    bad = final.pop("poison")
    assert bad.outputs[0].finish_reason == "error" and isinstance(bad.error, Injected)
    assert [final[f"good-{i}"].outputs[0].token_ids for i in range(3)] == [r.token_ids for r in refs]
    assert engine.get_metrics()["num_failed"] == failed_before + 1
    assert_clean(tiny_llm)


def test_failed_generate_raises_and_leaves_nothing_behind(tiny_llm, poisoned_sampling):
    refs = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="prompt 1 failed in the engine") as e:
        tiny_llm.generate(PROMPTS[:2], [GREEDY, POISON], use_tqdm=False)
    assert isinstance(e.value.__cause__, Injected)
    assert_clean(tiny_llm)
    assert texts(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == texts(refs)


def test_interrupted_generate_leaves_nothing_behind(tiny_llm, monkeypatch):
    """Ctrl-C in a notebook lands in the middle of a step."""
    refs = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    runner = tiny_llm.llm_engine.runner
    real, calls = runner.execute, []

    def execute(*step):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*step)

    monkeypatch.setattr(runner, "execute", execute)
    with pytest.raises(KeyboardInterrupt):
        tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert_clean(tiny_llm)
    assert texts(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == texts(refs)


def test_a_failing_proposer_costs_only_the_drafts(tiny_llm, monkeypatch):
    llm = LLM(model="tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    refs = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)

    def propose(seqs, ks, block_tables):
        raise Injected("the proposer failed")

    monkeypatch.setattr(llm.llm_engine.proposer, "propose", propose)
    assert texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == texts(refs)
    assert llm.get_metrics()["spec_decode_num_drafts"] == 0
    assert_clean(llm)
