"""Property-based fuzzing of the offline engine: hypothesis throws SamplingParams built from
whatever a careless caller might pass, and prompts of every shape, at `LLM.generate`.

For every call, exactly one of two things happens: the arguments are refused up front with a
ValueError / TypeError (and nothing was admitted), or every request finishes with "stop" or
"length" within its limits. Either way the engine is left clean: no request in it, no KV block
in use, its invariants intact, and a normal call afterwards gives the usual greedy text. A
RuntimeError (a request that failed inside a step) or any other exception fails the test.
Bounded: a 64-token context keeps each generation short.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmopt import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
MAX_MODEL_LEN = 64
NORMAL = SamplingParams(temperature=0.0, max_tokens=4)

# what a careless caller puts where a number goes: anything from NaN to 2**70, and the wrong type
floats = st.one_of(st.floats(), st.floats(0, 2), st.floats(0, 1e-30), st.floats(1e3, 1e6))
ints = st.one_of(st.integers(-3, 12), st.integers(-2**70, 2**70))
anything = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
texts = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=6)  # lone surrogates too
token_ids = st.lists(st.integers(-3, 4100), max_size=4)

# values inside every bound, its edges included: these must all be served. Near 0 a float32 holds
# less than a float64 (1e-40 is subnormal, 1e-46 rounds to 0): the values there are listed
TINY = st.sampled_from([5e-324, 1e-46, 1e-40, 1e-38, 1e-30, 9.99e-6])
IN_BOUNDS = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.just(0.0), TINY, st.floats(0, 1e-30), st.floats(1e-5, 2), st.floats(2, 1e4)),
    "top_p": st.one_of(st.just(1.0), TINY, st.floats(0, 1, exclude_min=True)),
    "top_k": st.one_of(st.integers(-1, 5), st.integers(-1, 2**70)),
    "min_p": st.floats(0, 1),
    "seed": st.one_of(st.none(), st.integers(-2**63, 2**64 - 1)),
    "max_tokens": st.one_of(st.none(), st.integers(1, 8)),
    "min_tokens": st.integers(0, 4),
    "stop": st.one_of(st.none(), texts.filter(bool), st.lists(texts.filter(bool), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 4095), max_size=4)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}).filter(lambda kw: kw.get("min_tokens", 0) <= (kw.get("max_tokens") or 8))
ANYTHING = st.fixed_dictionaries({}, optional={
    "n": st.one_of(st.just(1), ints),
    "temperature": st.one_of(floats, ints, anything),
    "top_p": st.one_of(floats, st.floats(0, 1), anything),
    "top_k": st.one_of(ints, floats),
    "min_p": st.one_of(floats, st.floats(0, 1)),
    "seed": st.one_of(st.none(), ints, floats),
    "max_tokens": st.one_of(st.none(), st.integers(1, 8), ints, floats),
    "min_tokens": st.one_of(st.integers(0, 8), ints),
    "stop": st.one_of(st.none(), texts, st.lists(texts, max_size=3), ints, token_ids),
    "stop_token_ids": st.one_of(st.none(), token_ids, ints, st.lists(texts, max_size=2)),
    "ignore_eos": st.one_of(st.booleans(), anything),
    "logprobs": st.one_of(st.none(), st.integers(-1, 25), anything),
    "skip_special_tokens": st.one_of(st.booleans(), anything),
    "include_stop_str_in_output": st.one_of(st.booleans(), anything),
})
SAMPLING = st.one_of(IN_BOUNDS, ANYTHING)
PROMPTS = st.one_of(
    st.text(st.sampled_from("def foo(x):\n return [1, 2]#'\"é→"), min_size=1, max_size=80),
    st.lists(st.integers(0, 4095), min_size=1, max_size=70).map(lambda ids: {"prompt_token_ids": ids}),
    texts,
    st.lists(st.integers(-3, 4100), max_size=70).map(lambda ids: {"prompt_token_ids": ids}),
    st.fixed_dictionaries({"prompt": texts}),
    anything,
)


@pytest.fixture(scope="module", params=[None, {"method": "ngram", "num_speculative_tokens": 3}],
                ids=["plain", "ngram"])
def llm(request):
    return LLM(model="tiny", device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=48,
               speculative_config=request.param)


@pytest.fixture(scope="module")
def normal_text(llm):
    return llm.generate("def f(x):", NORMAL, use_tqdm=False)[0].outputs[0].text


def generate_or_refuse(llm, calls):
    """LLM.generate on (prompt, kwargs) pairs: the outputs, or None if the arguments were refused."""
    try:
        params = [SamplingParams(**kwargs) for _, kwargs in calls]
    except (ValueError, TypeError):
        return None
    before = llm.get_metrics()["num_requests"]
    try:
        return llm.generate([p for p, _ in calls], params, use_tqdm=False), params
    except (ValueError, TypeError):
        assert llm.get_metrics()["num_requests"] == before  # refused before anything was admitted
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(calls=st.lists(st.tuples(PROMPTS, SAMPLING), min_size=1, max_size=3))
def test_any_arguments_are_refused_or_served_and_leave_the_engine_clean(llm, normal_text, calls):
    result = generate_or_refuse(llm, calls)
    if result is not None:
        outs, params = result
        for out, p in zip(outs, params):
            c = out.outputs[0]
            assert c.finish_reason in ("stop", "length"), c
            assert 1 <= len(c.token_ids) <= min(p.max_tokens or MAX_MODEL_LEN, MAX_MODEL_LEN)
            assert len(out.prompt_token_ids) + len(c.token_ids) <= MAX_MODEL_LEN
            if c.finish_reason == "length" and p.max_tokens and len(c.token_ids) < p.max_tokens:
                assert len(out.prompt_token_ids) + len(c.token_ids) == MAX_MODEL_LEN
            if p.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
    engine = llm.llm_engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.get_metrics()["kv_cache_usage_perc"] == 0.0
    engine.block_manager.check_invariants()
    assert llm.generate("def f(x):", NORMAL, use_tqdm=False)[0].outputs[0].text == normal_text
