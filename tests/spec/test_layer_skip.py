"""Self-speculative decoding by early exit: the target's first layers draft, the whole
target verifies. Greedy output equals plain decoding; sampling stays the target's
distribution (checked by seeded runs finishing and by the rejection sampler's own tests);
bad configurations are refused by name."""

import pytest

from llmopt import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("exit_layer", [2])
def test_layer_skip_greedy_equals_plain(tiny_llm, one_thread, exit_layer):
    plain = tokens(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(model="tiny", speculative_config={"method": "layer_skip", "exit_layer": exit_layer,
                                                "num_speculative_tokens": 3})
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert 0 <= m["spec_decode_num_accepted_tokens"] <= m["spec_decode_num_draft_tokens"]
    # the draft shares the target's pool: no extra KV bytes per block
    assert llm.llm_engine.bytes_per_block == LLM(model="tiny").llm_engine.bytes_per_block


def test_layer_skip_sampling_runs_seeded(one_thread):
    llm = LLM(model="tiny", speculative_config={"method": "layer_skip", "exit_layer": 3,
                                                "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7)
    a = tokens(llm.generate(PROMPTS[:1], params, use_tqdm=False))
    b = tokens(llm.generate(PROMPTS[:1], params, use_tqdm=False))
    assert a == b and len(a[0]) == 24


@pytest.mark.parametrize("config, message", [
    ({"method": "layer_skip", "num_speculative_tokens": 2}, "needs 'exit_layer'"),
    ({"method": "layer_skip", "exit_layer": 0, "num_speculative_tokens": 2}, "exit_layer"),
    ({"method": "layer_skip", "exit_layer": 6, "num_speculative_tokens": 2}, r"1\.\.5"),
    ({"method": "layer_skip", "exit_layer": 2, "model": "tiny-draft", "num_speculative_tokens": 2},
     "unknown keys"),
])
def test_bad_layer_skip_configs_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        LLM(model="tiny", speculative_config=config)
