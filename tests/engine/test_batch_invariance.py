"""Batch-invariant mode (enable_deterministic_inference, VLLM_BATCH_INVARIANT=1) on the CPU, bf16.

A request's greedy tokens AND their logprobs, bit for bit, are the same alone and in random
batches: 1 to 16 neighbours of random lengths, arriving in random order, prompts split into
chunks by a small token budget, a long prompt among them (its attention sliced). On SmolLM2: the
bundled tiny model's peaked logits hide what the batch changes (its logprobs agree bit for bit
even with the switch off), SmolLM2's do not (they move by tenths of a nat with it off). The
switch's spellings and refusals too. (benchmarks/batch_invariance.py runs the issue's 50 batches on
SmolLM2 and measures the cost.)
"""

from __future__ import annotations

import argparse
import random

import pytest

from llmopt import LLM, SamplingParams
from llmopt.config import EngineConfig
from llmopt.engine_args import add_engine_flags, engine_kwargs
from llmopt.kernels import cpu

needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"no C++ CPU kernels: {cpu.why_unavailable()}")
KW = dict(dtype="bfloat16", enable_chunked_prefill=True, max_num_batched_tokens=48, max_num_seqs=17,
          num_kv_blocks=512, enable_deterministic_inference=True)


def tokens_and_logprobs(out):
    o = out.outputs[0]
    return list(o.token_ids), [next(iter(d.values())).logprob for d in o.logprobs]


@needs_kernels
def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_batch():
    llm = LLM("smollm2", **KW)
    assert llm.llm_engine.runner.backend.batch_invariant
    rng = random.Random(0)
    target = {"prompt_token_ids": [rng.randrange(3, 40000) for _ in range(300)]}  # > 256 keys: sliced attention
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    alone = tokens_and_logprobs(llm.generate([target], params, use_tqdm=False)[0])
    for trial in range(5):
        n = rng.randint(1, 16)
        others = [{"prompt_token_ids": [rng.randrange(3, 40000) for _ in range(rng.randint(2, 80))]} for _ in range(n)]
        at = rng.randint(0, n)
        prompts = others[:at] + [target] + others[at:]
        ps = [params if i == at else SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), ignore_eos=True)
              for i in range(n + 1)]
        got = tokens_and_logprobs(llm.generate(prompts, ps, use_tqdm=False)[at])
        assert got == alone, f"batch {trial} ({n} neighbours, the request at {at}) changed its tokens or logprobs"


def test_the_switch_and_its_environment_variable(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert EngineConfig().enable_deterministic_inference is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().enable_deterministic_inference is True
    assert EngineConfig(enable_deterministic_inference=False).enable_deterministic_inference is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be 1"):
        EngineConfig()
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args(["--enable-deterministic-inference"]))["enable_deterministic_inference"] is True
    assert engine_kwargs(p.parse_args([]))["enable_deterministic_inference"] is None


@pytest.mark.parametrize("kw, match", [
    (dict(enable_deterministic_inference="yes"), "must be True or False"),
    (dict(enable_deterministic_inference=True, enforce_eager=True), "enforce_eager=True runs torch's matmuls"),
    (dict(enable_deterministic_inference=True, pipeline_parallel_size=2), "not supported with tensor_parallel"),
])
def test_bad_combinations_are_refused_before_loading(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EngineConfig(**kw)


@needs_kernels
def test_a_pool_the_compiled_step_cannot_read_is_refused_by_name():
    with pytest.raises(ValueError, match="needs the compiled CPU step.*FP8 pools"):
        LLM("tiny", dtype="bfloat16", kv_cache_dtype="fp8", num_kv_blocks=16, enable_deterministic_inference=True)
