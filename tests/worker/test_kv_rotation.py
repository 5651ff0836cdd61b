"""A rotated KV cache (PagedKVCache.rotate): keys and values are stored turned by a Hadamard
matrix R, queries turned alike, the output turned back. Unrounded it computes what the plain
cache computes; in FP8 it computes what rounding the rotated keys and values, then turning
them back, computes (its emulation); the compiled decode step declines a rotated pool."""

import pytest
import torch

from llmopt import LLM
from llmopt.eval import window_nll
from llmopt.fp8.format import dequantize_fp8, quantize_fp8
from llmopt.fp8.kv_scales import calibration_token_ids
from llmopt.layers.hadamard import random_hadamard
from llmopt.worker.compiled_decode import why_not
from llmopt.worker.kv_cache import NoKVCache

from test_fp8_kv_heads import TEXT, emulated_nll


class EmulatedRotatedFP8KV(NoKVCache):
    """Whole sequences, no cache: k and v turned by R, rounded to e4m3 with per-head scales, turned back."""

    def __init__(self, rotation, k_scale, v_scale):
        self.r, self.k_scale, self.v_scale = rotation, k_scale, v_scale

    def store(self, layer, k, v, meta):
        def rounded(x, s):
            return dequantize_fp8(quantize_fp8(x @ self.r, s), s, x.dtype) @ self.r.T
        return rounded(k, self.k_scale[layer]), rounded(v, self.v_scale[layer])


def ids_of(llm):
    return llm.llm_engine.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:161]


def test_rotation_leaves_attention_unchanged_and_the_compiled_step_declines_it():
    llm = LLM("tiny", block_size=16)
    ids = ids_of(llm)
    (want, _), = window_nll(llm, token_ids=ids, seq_len=160, chunk_size=32)
    engine = llm.llm_engine
    engine.kv_cache.rotate(seed=3)
    r = engine.kv_cache.rotation
    assert torch.allclose(r @ r.T, torch.eye(r.shape[0]), atol=1e-6)      # orthogonal
    assert r.abs().min() == pytest.approx(r.abs().max())                  # every entry +-1/sqrt(D)
    (got, _), = window_nll(llm, token_ids=ids, seq_len=160, chunk_size=32)
    assert got == pytest.approx(want, rel=1e-5)
    assert "rotated" in why_not(engine.model, engine.kv_cache, "cpu")


def test_rotated_fp8_cache_equals_its_emulation_and_is_not_the_plain_one():
    llm = LLM("tiny", kv_cache_dtype="fp8", block_size=16)
    engine = llm.llm_engine
    pool = engine.kv_cache
    calibration = calibration_token_ids(engine.tokenizer, num_tokens=1024)
    pool.calibrate(engine.model, calibration, per_head=True, rotate=True)
    assert pool.scale_source == "calibrated per head, rotated"
    ids = ids_of(llm)
    # windows of 160 fed in chunks of 32: later chunks read their context back from fp8 blocks
    (got, n), = window_nll(llm, token_ids=ids, seq_len=160, chunk_size=32)
    want = emulated_nll(engine.model, ids, EmulatedRotatedFP8KV(pool.rotation, pool.k_scale, pool.v_scale))
    assert n == 160 and got == pytest.approx(want, rel=1e-5)
    # the scales were measured on rotated keys: a rotation spreads a key's largest channel out,
    # so the largest rotated |key| differs from the largest plain one
    plain = LLM("tiny", kv_cache_dtype="fp8", block_size=16)
    plain.llm_engine.kv_cache.calibrate(plain.llm_engine.model, calibration, per_head=True)
    assert not torch.allclose(plain.llm_engine.kv_cache.k_scale[0], pool.k_scale[0])
    (unrotated, _), = window_nll(plain, token_ids=ids, seq_len=160, chunk_size=32)
    assert unrotated != pytest.approx(got, rel=1e-7)


def test_rotation_is_the_same_matrix_as_the_weight_rotations():
    pool = LLM("tiny", kv_cache_dtype="fp8").llm_engine.kv_cache
    pool.rotate(seed=5)
    d = pool.k[0].shape[3]
    assert torch.equal(pool.rotation, random_hadamard(d, 5).float())
