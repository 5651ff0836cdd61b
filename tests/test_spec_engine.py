"""n-gram speculative decoding inside the engine: greedy output equals plain greedy decoding,
alone and batched, with prefix caching, chunked prefill and preemption; stops land where
plain decoding puts them; rejected drafts' blocks are rolled back."""

import pytest

from llmopt import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = ["import os\nimport sys\nimport os\nimport sys\nimport",
           "def f(x):\n    return x\n\n\ndef g(x):\n    return x\n\n\ndef",
           "class A:\n    def __init__(self):\n        self.a = 1\n        self.b = 2\n        self.",
           "x = [1, 2, 3, 1, 2, 3, 1, 2,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llm):
    return tokens(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_greedy_ngram_equals_plain_greedy(plain):
    llm = LLM(model="tiny", speculative_config=NGRAM)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    for i, p in enumerate(PROMPTS):  # and each request alone
        assert tokens(llm.generate([p], GREEDY, use_tqdm=False)) == [plain[i]]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts"] > 0
    assert 0 < m["spec_decode_num_accepted_tokens"] <= m["spec_decode_num_draft_tokens"]
    per_pos = [m[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(4)]
    assert sum(per_pos) == m["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # position i is reached only through i - 1
    assert m["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_drafts"])
    assert m["generation_tokens"] == 2 * len(PROMPTS) * 48
    llm.llm_engine.block_manager.check_invariants()


def test_with_chunked_prefill_prefix_caching_and_preemption(plain):
    tight = LLM(model="tiny", speculative_config=NGRAM, block_size=8, num_kv_blocks=14,
                max_num_batched_tokens=9)
    assert tokens(tight.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    assert tight.get_metrics()["num_preemptions"] > 0
    eng = tight.llm_engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    # a second pass hits the prefix cache and still gives the same tokens
    assert tokens(tight.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain


def test_stops_inside_an_accepted_run_match_plain(tiny_llm):
    spec = LLM(model="tiny", speculative_config=NGRAM)
    for params in (SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=48, stop=["sys"], ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=48)):
        want = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
        got = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
            [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]


def test_sampling_with_speculation_runs_and_keeps_blocks_consistent():
    llm = LLM(model="tiny", speculative_config=NGRAM, block_size=8)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True)
              for s in range(4)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(t) for t in tokens(outs)] == [40] * 4
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(again) == tokens(outs)  # seeded: reproducible
    eng = llm.llm_engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("config,match", [
    ({"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4}, "not implemented"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
])
def test_bad_speculative_config(config, match):
    with pytest.raises(ValueError, match=match):
        LLM(model="tiny", speculative_config=config)
