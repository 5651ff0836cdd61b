"""The engine the viz tests draw from: the tiny model in float32, traced, on a small KV pool
(32 blocks, so block tables and preemptions stay readable), without prefix caching."""

from llmopt import LLM


def make_llm(**knobs) -> LLM:
    settings = dict(model="tiny", device="cpu", dtype="float32", seed=0, enable_trace=True,
                    num_kv_blocks=32, enable_prefix_caching=False)
    settings.update(knobs)
    return LLM(**settings)
