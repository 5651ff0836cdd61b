"""Every bad constraint is refused before any work with a ValueError/TypeError naming the field:
malformed specs, specs the compiler rejects (with its message), hostile ones (deep nesting, huge
enums, exploding regexes), combinations a grammar cannot serve; and the engine serves the next
request. Sampling under a mask draws from the model's distribution renormalized over the allowed
tokens (chi-square, with a negative control that masks after top-p instead of before)."""

import concurrent.futures
import threading

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from llmopt import SamplingParams, StructuredOutputsParams
from llmopt.layers.sampler import sample
from llmopt.structured.bitmask import apply_token_bitmask


def deep_schema(levels):
    s = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.mark.parametrize("kwargs, error, words", [
    ({}, ValueError, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, ValueError, "exactly one"),
    ({"json": 3}, TypeError, "JSON schema"),
    ({"json": "{not json"}, ValueError, "not valid JSON"),
    ({"regex": ""}, TypeError, "non-empty string"),
    ({"choice": []}, TypeError, "non-empty list"),
    ({"choice": ["a", 2]}, TypeError, "non-empty list"),
    ({"json_object": "yes"}, TypeError, "must be True"),
    ({"grammar": "x" * 70_000}, ValueError, "at most 65,536"),
    ({"json": deep_schema(40)}, ValueError, "nests deeper"),
    ({"json": {"enum": list(range(2000))}}, ValueError, "at most 1,024"),
    ({"json": {"anyOf": [{"enum": list(range(1000))}] * 5}}, ValueError, "enum/const values"),
    ({"choice": [str(i) for i in range(2000)]}, ValueError, "at most 1,024"),
    ({"regex": "(a{100}){100}"}, ValueError, "10,000 times"),
    ({"regex": "((((a{10}){10}){10}){10})"}, ValueError, "at most 1,000"),
    ({"regex": "(" * 40 + "a" + ")" * 40}, ValueError, "nests groups"),
    ({"regex": "a", "disable_any_whitespace": 1}, TypeError, "True or False"),
])
def test_malformed_and_hostile_specs(kwargs, error, words):
    with pytest.raises(error, match=words):
        StructuredOutputsParams(**kwargs)


def test_counted_repetitions_within_bounds_and_literal_braces_pass():
    for regex in (r"[0-9]{3}-(ab){100}", r"x{2,}", r"[{}]{5}", r"\{a\}{3}", r"(a{10}){100}"):
        StructuredOutputsParams(regex=regex)


@pytest.mark.parametrize("kwargs, words", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json does not compile: Unsupported type"),
    ({"regex": "(("}, "structured_outputs.regex does not compile"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar does not compile"),
    ({"grammar": 'root ::= other'}, "structured_outputs.grammar does not compile"),
])
def test_what_the_compiler_rejects_is_a_value_error_before_any_work(tiny_llm, kwargs, words):
    params = [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))]
    steps = tiny_llm.llm_engine.step_count
    with pytest.raises(ValueError, match=f"request 1: {words}"):
        tiny_llm.generate(["a", "b"], params, use_tqdm=False)
    assert tiny_llm.llm_engine.step_count == steps and not tiny_llm.llm_engine.has_unfinished_requests()
    assert tiny_llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, words", [
    ({"ignore_eos": True}, "ignore_eos cannot be combined"),
    ({"min_tokens": 2}, "min_tokens cannot be combined"),
])
def test_combinations_a_grammar_cannot_serve(tiny_llm, kwargs, words):
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]+"), **kwargs)
    with pytest.raises(ValueError, match=words):
        tiny_llm.generate(["a"], params, use_tqdm=False)


def test_structured_outputs_must_be_the_params_class():
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_a_failing_compile_fails_only_its_request_in_the_engine(tiny_llm):
    """Through add_request (the server's engine thread): the grammar compiles in a worker, the
    free request runs meanwhile; the bad one ends with finish_reason "error"."""
    engine = tiny_llm.llm_engine
    engine.add_request("free", "def f(x):", SamplingParams(temperature=0, max_tokens=6))
    engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[z-a]")))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["free"].outputs[0].finish_reason == "length" and len(done["free"].outputs[0].token_ids) == 6
    assert done["bad"].outputs[0].finish_reason == "error" and "does not compile" in str(done["bad"].error)


# -- the distribution under a mask ------------------------------------------------------------------
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0] * 3)
ALLOWED = [1, 3, 4, 6, 8, 13, 20, 30, 33]


def bitmask(allowed, vocab):
    words = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def renormalized(logits, allowed, temperature, top_p):
    """The model's distribution over the allowed tokens only, then temperature and top-p."""
    z = logits.numpy().astype(np.float64)[allowed] / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep, mass = np.zeros_like(p, dtype=bool), 0.0
    for i in np.argsort(-p, kind="stable"):
        keep[i] = mass < top_p
        mass += p[i]
    q = np.zeros(len(logits))
    q[allowed] = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    return q


def draw(logits, n, temperature, top_p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    rows = logits[None].repeat(n, 1)
    masked = apply_token_bitmask(rows, bitmask(ALLOWED, len(logits)).repeat(n, 1), list(range(n)))
    return np.bincount(sample(masked, [params] * n, [gen] * n).numpy(), minlength=len(logits))


def p_value(counts, probs):
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the allowed set was drawn"
    return chisquare(counts[support], probs[support] * counts.sum()).pvalue


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_masked_sampling_is_the_renormalized_distribution(temperature, top_p):
    counts = draw(LOGITS, 20_000, temperature, top_p)
    assert p_value(counts, renormalized(LOGITS, ALLOWED, temperature, top_p)) > 1e-3


def test_negative_control_top_p_before_the_mask_is_detected():
    """Top-p over the whole vocabulary first, then the mask, keeps a different set: the test
    above would notice if the sampler filtered in that order."""
    counts = draw(LOGITS, 20_000, 1.3, 0.8)
    z = LOGITS.numpy().astype(np.float64) / 1.3
    p = np.exp(z - z.max())
    p /= p.sum()
    keep, mass = np.zeros_like(p, dtype=bool), 0.0
    for i in np.argsort(-p, kind="stable"):
        keep[i] = mass < 0.8
        mass += p[i]
    wrong = np.zeros_like(p)
    wrong[ALLOWED] = (p * keep)[ALLOWED]
    wrong /= wrong.sum()
    support = wrong > 0
    assert counts[~support].sum() > 0 or p_value(counts, wrong) < 1e-6


class RunsAtOnce(concurrent.futures.Executor):
    """An executor whose futures are done when `submit` returns: a compile that finished (a bad
    spec fails in microseconds) before the compiler attached its callback, made certain."""

    def submit(self, fn, *args, **kwargs):
        f = concurrent.futures.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the future carries it, as a pool's would
            f.set_exception(e)
        return f


@pytest.mark.parametrize("spec", [{"regex": "(("}, {"regex": "[ab]+"}])
def test_a_compile_done_before_its_callback_is_attached_returns(tiny_llm, spec):
    """The callback of an already finished future runs inside add_done_callback, in the caller's
    thread; attached while the compiler held its lock, it waited for that lock forever (a CI run
    hung here when a failing compile beat the callback)."""
    compiler = tiny_llm.llm_engine.structured.compiler
    pool, compiler._pool = compiler._pool, RunsAtOnce()
    params = StructuredOutputsParams(**spec)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(compiler.submit(params).exception()), daemon=True)
    try:
        worker.start()
        worker.join(timeout=60)
    finally:
        compiler._pool = pool
    assert not worker.is_alive(), "submit never returned: its callback waited for the compiler's lock"
    assert (outcome[0] is None) == ("+" in spec["regex"]), outcome  # the bad spec's error is its future's
