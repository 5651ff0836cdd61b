"""DeepSeek (MLA + MoE) in the paged engine: the optimized paths give the plain path's tokens.

Chunked = unchunked prefill, prefix cache warm = cold, forced preemption, speculative
greedy (n-gram and layer-skip) = plain; the pool's bytes per token equal lesson 01's MLA
formula; the trace carries the router's tokens per expert.
"""

import pytest
import torch
from deepseek_checkpoints import write_deepseek

from llmopt import LLM, SamplingParams
from llmopt.kv_bytes import KVSpec, kv_bytes_per_token, mla_bytes_per_token

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(write_deepseek("ds-yarn", tmp_path_factory.mktemp("ds")))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 4096, (24,), generator=g).tolist()  # a common prefix of 3 blocks
    return [{"prompt_token_ids": shared + torch.randint(3, 4096, (n,), generator=g).tolist()}
            for n in (2, 9, 17, 30)]


def run(folder, prompts, **kw):
    llm = LLM(model=folder, block_size=8, **{"num_kv_blocks": 64, **kw})
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(folder, prompts, one_thread):
    return run(folder, prompts, enable_prefix_caching=False, enable_chunked_prefill=False)[1]


def test_chunked_prefill_equals_unchunked(folder, prompts, reference):
    llm, got = run(folder, prompts, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert got == reference


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_prefix_cache_warm_equals_cold(folder, prompts, reference, prefix_cache):
    llm, cold = run(folder, prompts, prefix_cache=prefix_cache)
    warm = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert cold == warm == reference
    assert llm.get_metrics()["prefix_cache_hits"] >= 4 * 24
    if prefix_cache == "radix":  # every warm prompt but its last token, latent rows of partial blocks copied
        assert llm.get_metrics()["prefix_cache_hits"] == sum(len(p["prompt_token_ids"]) - 1 for p in prompts)


def test_forced_preemption_gives_the_same_tokens(folder, prompts, reference):
    llm, got = run(folder, prompts, num_kv_blocks=10, enable_prefix_caching=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert got == reference


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "layer_skip", "exit_layer": 1, "num_speculative_tokens": 3}])
def test_speculative_greedy_equals_plain(folder, prompts, reference, spec):
    llm, got = run(folder, prompts, speculative_config=spec)
    assert got == reference
    if spec["method"] == "layer_skip":  # (random tokens give n-gram lookup little to find)
        assert llm.get_metrics()["spec_decode_num_drafts"] > 0


def test_pool_bytes_per_token_equal_the_formula(folder):
    llm = LLM(model=folder, num_kv_blocks=16, block_size=8)
    pool = llm.llm_engine.kv_cache
    spec = KVSpec.from_pretrained(folder)
    assert spec.attention == "MLA"
    # 3 layers x (32 latent + 16 rope) x 4 bytes = 576: measured from the tensors the pool holds
    assert pool.bytes_per_token() == mla_bytes_per_token(3, 32, 16, 4) == spec.bytes_per_token(4) == 576
    # the MHA it replaces: lesson 01 counts K and V of 4 heads x 32 per layer
    assert kv_bytes_per_token(3, 4, spec.head_dim, 4) == 3072


def test_trace_counts_tokens_per_expert(folder, prompts):
    llm = LLM(model=folder, num_kv_blocks=64, block_size=8, enable_trace=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    for step in llm.llm_engine.trace:
        tokens = sum(s["num_tokens"] for s in step["scheduled"])
        moe = step["moe"]
        assert sorted(moe["tokens_per_expert"]) == [1, 2]  # layer 0 is dense
        for layer, counts in moe["tokens_per_expert"].items():
            assert len(counts) == 8 and sum(counts) == 2 * tokens  # top-2 of 8 experts
            assert moe["load_imbalance"][layer] == pytest.approx(max(counts) / (sum(counts) / 8))
            assert len(moe["expert_ids"][layer]) == tokens


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_tensor_or_pipeline_parallel_mla_is_refused_before_any_worker_starts(folder, split):
    import llmopt.distributed.executor as executor

    started = []
    real_spawn, executor._spawn = executor._spawn, lambda args: started.append(args)
    try:
        with pytest.raises(ValueError, match="do not shard MLA"):
            LLM(model=folder, num_kv_blocks=16, **split)
    finally:
        executor._spawn = real_spawn
    assert started == []
