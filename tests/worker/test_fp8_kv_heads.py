"""Per-head FP8 KV scales: calibration finds each KV head's own amax, and the paged cache
(chunked prefill reading fp8 blocks back, then decode) computes what an emulation computes:
keys and values rounded through fp8(x / s_head) * s_head before plain attention. Key smoothing
(the mean key subtracted before storing) leaves attention unchanged, and its FP8 path equals
its emulation too."""

import pytest
import torch

from llmopt import LLM
from llmopt.eval import window_nll
from llmopt.fp8.format import dequantize_fp8, quantize_fp8, scale_from_amax
from llmopt.fp8.kv_scales import calibration_token_ids
from llmopt.layers.attention import AttentionMetadata
from llmopt.model.forward import run_model
from llmopt.worker.kv_cache import NoKVCache, observe_kv_amax


class EmulatedFP8KV(NoKVCache):
    """Whole sequences, no cache; k and v rounded to e4m3 with per-head scales [Hkv, 1] first."""

    def __init__(self, k_scale, v_scale, k_shift=None):
        self.k_scale, self.v_scale, self.k_shift = k_scale, v_scale, k_shift

    def store(self, layer, k, v, meta):  # attention reads what this returns: k and v as the pool holds them
        ks, vs = self.k_scale[layer], self.v_scale[layer]
        if self.k_shift is not None:
            k = k - self.k_shift[layer]
        k = dequantize_fp8(quantize_fp8(k, ks), ks, k.dtype)
        v = dequantize_fp8(quantize_fp8(v, vs), vs, v.dtype)
        return k, v


@torch.no_grad()
def emulated_nll(model, ids, cache):
    hidden = run_model(model, cache, torch.tensor(ids[:-1]), AttentionMetadata.uncached([len(ids) - 1]))
    return torch.nn.functional.cross_entropy(model.compute_logits(hidden), torch.tensor(ids[1:]),
                                             reduction="sum").item()


def test_per_head_calibration_finds_each_heads_amax():
    llm = LLM("tiny", kv_cache_dtype="fp8")
    engine = llm.llm_engine
    ids = calibration_token_ids(engine.tokenizer, num_tokens=1024)
    k_head, v_head = observe_kv_amax(engine.model, ids, len(engine.kv_cache.k), per_head=True)
    k_layer, _ = observe_kv_amax(engine.model, ids, len(engine.kv_cache.k))
    heads = engine.model_config.num_key_value_heads
    assert all(t.shape == (heads,) for t in k_head + v_head)
    assert [float(t.max()) for t in k_head] == pytest.approx(k_layer)    # the layer's amax is its largest head's
    assert any(float(t.min()) < 0.8 * float(t.max()) for t in k_head)    # heads differ: the point of it
    engine.kv_cache.calibrate(engine.model, ids, per_head=True)
    assert engine.kv_cache.scale_source == "calibrated per head"
    assert torch.equal(engine.kv_cache.k_scale[0].reshape(-1), scale_from_amax(k_head[0]))


@pytest.mark.parametrize("per_channel", [False, True])
def test_paged_per_head_fp8_equals_its_emulation(per_channel):
    llm = LLM("tiny", kv_cache_dtype="fp8", block_size=16)
    engine = llm.llm_engine
    engine.kv_cache.calibrate(engine.model, calibration_token_ids(engine.tokenizer, num_tokens=1024),
                              per_head=True, per_channel=per_channel)
    d = engine.model_config.head_dim if per_channel else 1
    assert engine.kv_cache.k_scale[0].shape == (engine.model_config.num_key_value_heads, d)
    text = engine.tokenizer("def main():\n    return [x * x for x in range(10)]\n" * 12,
                            add_special_tokens=False)["input_ids"][:161]
    # windows of 160 fed in chunks of 32: later chunks read their context back from fp8 blocks
    (got, n), = window_nll(llm, token_ids=text, seq_len=160, chunk_size=32)
    want = emulated_nll(engine.model, text, EmulatedFP8KV(engine.kv_cache.k_scale, engine.kv_cache.v_scale))
    assert n == 160 and got == pytest.approx(want, rel=1e-5)
    # per-tensor scales give another answer (the per-head path is not silently per tensor)
    per_tensor = [s.max().reshape(1, 1).expand_as(s) for s in engine.kv_cache.k_scale]
    other = emulated_nll(engine.model, text, EmulatedFP8KV(per_tensor, engine.kv_cache.v_scale))
    assert other != pytest.approx(want, rel=1e-7)


def test_per_head_scales_are_checked():
    llm = LLM("tiny", kv_cache_dtype="fp8")
    pool = llm.llm_engine.kv_cache
    n, heads = len(pool.k), pool.k[0].shape[2]
    with pytest.raises(ValueError, match="one per KV head"):
        pool.set_scales([[1.0] * (heads + 1)] * n, [1.0] * n)
    with pytest.raises(ValueError, match="positive finite"):
        pool.set_scales([[1.0] * (heads - 1) + [0.0]] * n, [1.0] * n)


TEXT = "def main():\n    return [x * x for x in range(10)]\n" * 12


def test_key_smoothing_leaves_attention_unchanged_and_matches_its_emulation():
    plain = LLM("tiny", block_size=16)
    ids = plain.llm_engine.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:161]
    (want, _), = window_nll(plain, token_ids=ids, seq_len=160, chunk_size=32)
    pool = plain.llm_engine.kv_cache
    g = torch.Generator().manual_seed(0)
    pool.k_shift = [torch.randn(pool.k[0].shape[2], pool.k[0].shape[3], generator=g) * 3 for _ in pool.k]
    (shifted, _), = window_nll(plain, token_ids=ids, seq_len=160, chunk_size=32)
    assert shifted == pytest.approx(want, rel=1e-5)        # q.(k - c): every score of a query moves alike

    llm = LLM("tiny", kv_cache_dtype="fp8", block_size=16)
    engine = llm.llm_engine
    engine.kv_cache.calibrate(engine.model, calibration_token_ids(engine.tokenizer, num_tokens=1024),
                              per_head=True, smooth_keys=True)
    shift = engine.kv_cache.k_shift
    assert len(shift) == len(engine.kv_cache.k) and shift[0].shape == engine.kv_cache.k[0].shape[2:]
    (got, _), = window_nll(llm, token_ids=ids, seq_len=160, chunk_size=32)
    emulated = emulated_nll(engine.model, ids, EmulatedFP8KV(engine.kv_cache.k_scale, engine.kv_cache.v_scale,
                                                             shift))
    assert got == pytest.approx(emulated, rel=1e-5)
