"""The paged engine: optimized paths give exactly the tokens of the plain ones.

Greedy decoding must be token-identical between: paged and contiguous attention;
chunked and unchunked prefill; prefix cache warm, cold and 100% hit; a request alone
and co-scheduled with others; runs with forced preemption and without.
"""

import pytest

from llmopt import LLM, SamplingParams
from llmopt.engine.reference_loops import generate_with_cache
from llmopt.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):\n        self.items = []\n",
           "import os\nimport sys\n\n\ndef main(argv):\n    parser = ", "x = [", "    return"]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llm):
    """Plain greedy: one request at a time through the contiguous (non-paged) cache."""
    out = []
    for p in PROMPTS:
        seq = Sequence("ref", p, tiny_llm.tokenizer(p)["input_ids"], GREEDY)
        generate_with_cache(tiny_llm.model, [seq], eos_token_ids=tiny_llm.eos_token_ids,
                            max_model_len=tiny_llm.max_model_len)
        out.append(seq.output_token_ids)
    return out


def test_paged_engine_equals_contiguous_cache(reference):
    llm = LLM(model="tiny", enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_give_the_same_tokens(reference, block_size):
    llm = LLM(model="tiny", block_size=block_size)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_chunked_prefill_equals_unchunked(reference):
    # a 7-token budget splits every prompt into chunks, mixed with other requests' decodes
    chunked = LLM(model="tiny", max_num_batched_tokens=7, enable_chunked_prefill=True, enable_trace=True)
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    trace = chunked.llm_engine.trace
    assert any(0 < s["context_len"] < 10 and s["kind"] == "prefill" for t in trace for s in t["scheduled"])
    assert any(t["num_prefill_tokens"] and t["num_decode_tokens"] for t in trace)  # mixed steps
    assert all(sum(s["num_tokens"] for s in t["scheduled"]) <= 7 for t in trace)
    unchunked = LLM(model="tiny", enable_chunked_prefill=False)
    assert tokens(unchunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_prefix_cache_warm_equals_cold(reference):
    system = "# Utilities shared by every request in this file.\nimport math\nimport os\n\n\n"
    prompts = [system + p for p in PROMPTS]
    cold = LLM(model="tiny", enable_prefix_caching=False)
    expected = tokens(cold.generate(prompts, GREEDY, use_tqdm=False))
    warm = LLM(model="tiny", block_size=8)
    first = tokens(warm.generate(prompts[:1], GREEDY, use_tqdm=False))
    hits_before = warm.get_metrics()["prefix_cache_hits"]
    rest = tokens(warm.generate(prompts[1:], GREEDY, use_tqdm=False))
    assert first + rest == expected
    n_system = len(warm.tokenizer(system)["input_ids"])
    # every later request shares at least the system prompt's full blocks
    assert warm.get_metrics()["prefix_cache_hits"] - hits_before >= 4 * (n_system // 8) * 8


def test_full_prefix_hit_still_computes_the_last_token():
    llm = LLM(model="tiny", block_size=8)
    ids = llm.tokenizer("def parse(text):\n    tokens = text.split()\n    return")["input_ids"]
    ids = ids[:16]  # exactly two full blocks
    first = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 8)
    # a prompt of whole cached blocks may hit all but the block holding its last token
    m = llm.get_metrics()
    assert m["prefix_cache_hits"] == 8 and m["prefix_cache_queries"] == 32
    # a longer request whose prompt is fully cached (prompt + its own output) hits more
    extended = ids + first.outputs[0].token_ids[:9]
    llm.generate([{"prompt_token_ids": extended}], GREEDY, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] == 8 + 24


def test_request_alone_equals_co_scheduled(reference):
    llm = LLM(model="tiny")
    alone = tokens(llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False))
    mixed = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 40, 17, 60, 1)]
    together = tokens(llm.generate(PROMPTS, mixed, use_tqdm=False))
    assert together[1] == alone[0] == reference[1]
    assert [len(t) for t in together] == [5, 40, 17, 60, 1]


def test_forced_preemption_gives_the_same_tokens(reference):
    # 14 blocks of 8 tokens cannot hold five growing sequences: some must be preempted
    llm = LLM(model="tiny", block_size=8, num_kv_blocks=14, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.get_metrics()["num_preemptions"] > 0
    llm.llm_engine.block_manager.check_invariants()
    assert llm.llm_engine.block_manager.num_free_blocks == 14


def test_preemption_with_prefix_caching_and_seeded_sampling():
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=30, ignore_eos=True) for s in range(5)]
    roomy = tokens(LLM(model="tiny").generate(PROMPTS, params, use_tqdm=False))
    tight = LLM(model="tiny", block_size=8, num_kv_blocks=14)
    assert tokens(tight.generate(PROMPTS, params, use_tqdm=False)) == roomy
    assert tight.get_metrics()["num_preemptions"] > 0


def test_priority_order_is_honoured():
    llm = LLM(model="tiny", scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                        priority=[3, 1, 2, 0], use_tqdm=False)
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [3, 1, 2, 0]


def test_higher_priority_arrival_preempts():
    llm = LLM(model="tiny", scheduling_policy="priority", max_num_seqs=1)
    eng = llm.llm_engine
    eng.add_request("low", "def f(x):", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                    priority=5)
    eng.step()
    eng.step()
    eng.add_request("high", "class A:", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                    priority=0)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished == ["high", "low"]
    assert eng.get_metrics()["num_preemptions"] == 1


def test_request_that_can_never_fit_is_rejected():
    llm = LLM(model="tiny", block_size=8, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate(["def f(x):"], SamplingParams(max_tokens=100), use_tqdm=False)
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=10), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 10


def test_unchunked_prompt_over_the_token_budget_is_rejected_not_hung():
    llm = LLM(model="tiny", enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.generate([{"prompt_token_ids": [5] * 12}], SamplingParams(max_tokens=8), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [5] * 8}], SamplingParams(max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 8


def test_step_api_streams_and_abort_frees_blocks():
    llm = LLM(model="tiny", block_size=8)
    eng = llm.llm_engine
    free0 = eng.block_manager.num_free_blocks
    eng.add_request("a", "def f(x):", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    eng.add_request("b", "import os", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    seen = {"a": [], "b": []}
    for _ in range(8):
        for out in eng.step():
            seen[out.request_id].append(len(out.outputs[0].token_ids))
    assert seen["b"] == [1, 2, 3, 4, 5] and seen["a"] == list(range(1, 9))
    eng.abort_request("a")
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == free0
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("c", "x", None)
        eng.add_request("c", "x", None)


def test_kv_usage_and_memory_stats():
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=100, enable_trace=True)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    trace = llm.llm_engine.trace
    peak = max(t["kv_cache_usage_perc"] for t in trace)
    assert 0 < peak <= 1
    for t in trace:
        assert t["tokens_stored"] <= t["slots_reserved"] == t["blocks_used"] * 16
    assert llm.get_metrics()["kv_cache_usage_perc"] == 0.0  # all finished, all freed


def test_vllms_documented_example_runs_unchanged():
    """API.md: vLLM's own example runs with only the import and the model name changed."""
    llm = LLM(model="tiny", tensor_parallel_size=1, gpu_memory_utilization=0.9,
              max_num_seqs=256, max_num_batched_tokens=8192, enable_chunked_prefill=True)
    outputs = llm.generate(["def quicksort(xs):"],
                           SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2048), use_tqdm=False)
    out = outputs[0].outputs[0]
    assert out.finish_reason in ("stop", "length") and out.text
    if out.finish_reason == "length":  # capped by max_model_len, as vLLM does
        assert len(outputs[0].prompt_token_ids) + len(out.token_ids) == llm.max_model_len
    assert set(llm.get_metrics()) >= {"kv_cache_usage_perc", "num_preemptions", "prefix_cache_queries",
                                      "prefix_cache_hits", "spec_decode_num_drafts",
                                      "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"}
