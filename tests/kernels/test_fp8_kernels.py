"""PagedAttention over an FP8 pool: `write_kv` stores fp8(clamp(x / scale)), the torch
reference reads fp8 * scale, and both Triton kernels (decode, prefill) equal the reference
under TRITON_INTERPRET=1, for e4m3 and e5m2, through the native fp8 load and through the
byte-decoding path that GPUs before compute capability 8.9 take.

The fp8 pools are made from the full-precision test batches, so every slot no token owns
still holds NaN: a kernel that reads a wrong slot cannot pass.
"""

import pytest
import torch
from test_paged_attention_kernels import (DECODE_SEQ_LENS, DEVICE, MIXED_QUERY_LENS, MIXED_SEQ_LENS,
                                          make_batch, needs_triton)

from llmopt.fp8.format import dequantize_fp8, per_tensor_scale, quantize_fp8
from llmopt.kernels import paged_attention as pa
from llmopt.worker.kv_cache import write_kv  # the pool's write, as the engine does it before attention

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
QDTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def fp8_batch(seq_lens, query_lens, fp8, qdtype=torch.float32, magnitude=6.0, **kw):
    """A paged batch whose pool is fp8 with per-tensor scales calibrated on its keys/values.

    Keys and values are scaled up (and one key pushed far out) so that the scales matter:
    with `magnitude` 6 and an outlier of 100, a unit scale would clamp under e4m3's 448 only
    for the outlier, but would waste most of the grid's top.
    """
    b, dense_k, dense_v = make_batch(seq_lens, query_lens, **kw)
    k, v = b["k_cache"] * magnitude, b["v_cache"] * magnitude
    k[k.isfinite().nonzero()[0].unbind()] = 100.0  # one outlier key element
    finite = lambda x: x[x.isfinite()]  # noqa: E731  (NaN marks slots no token owns)
    k_scale, v_scale = per_tensor_scale(finite(k), fp8).item(), per_tensor_scale(finite(v), fp8).item()
    # clamp leaves NaN as NaN, and the cast keeps it: the unowned slots stay poisoned
    k8, v8 = quantize_fp8(k, k_scale, fp8), quantize_fp8(v, v_scale, fp8)
    assert k8.float().isnan().sum() == k.isnan().sum() > 0
    b = dict(b, q=b["q"].to(qdtype), k_cache=k8, v_cache=v8, k_scale=k_scale, v_scale=v_scale)
    return b, k, v


def reference(b, window=None):
    return pa.paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                  b["query_start_loc"], b["seq_lens"], b["scale"], window,
                                  b["k_scale"], b["v_scale"])


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype and not actual.isnan().any()
    torch.testing.assert_close(actual, expected, atol=TOL[dtype], rtol=TOL[dtype])


# ---- writing and the reference ------------------------------------------------------------------

@pytest.mark.parametrize("fp8", FP8)
def test_write_kv_stores_clamped_scaled_fp8_bytes(fp8):
    g = torch.Generator().manual_seed(0)
    shape = (6, 8, 2, 16)
    k_cache, v_cache = torch.zeros(shape, dtype=fp8), torch.zeros(shape, dtype=fp8)
    k = torch.randn(5, 2, 16, generator=g) * 30
    v = torch.randn(5, 2, 16, generator=g)
    k[0, 0, 0], v[1, 1, 1] = 1e9, -1e9  # far beyond any format's range: must clamp, not overflow
    slots = torch.tensor([3, 17, 40, 41, 8])
    write_kv(k, v, k_cache, v_cache, slots, k_scale=0.25, v_scale=2.0 ** -7)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    # byte for byte what llmopt.fp8.format computes, and nothing written elsewhere
    assert torch.equal(flat_k[slots].view(torch.uint8), quantize_fp8(k, 0.25, fp8).view(torch.uint8))
    assert torch.equal(flat_v[slots].view(torch.uint8), quantize_fp8(v, 2.0 ** -7, fp8).view(torch.uint8))
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[slots] = False
    assert flat_k[others].view(torch.uint8).eq(0).all() and flat_v[others].view(torch.uint8).eq(0).all()
    fmax = torch.finfo(fp8).max
    assert flat_k[3, 0, 0].float() == fmax and flat_v[17, 1, 1].float() == -fmax
    assert torch.isfinite(flat_k.float()).all() and torch.isfinite(flat_v.float()).all()


@pytest.mark.parametrize("fp8", FP8)
def test_reference_reads_fp8_times_scale(fp8):
    """The fp8 reference equals the full-precision reference run on the dequantized pool."""
    b, _, _ = fp8_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, fp8, group=2, block_size=8)
    widened = dict(b, k_cache=dequantize_fp8(b["k_cache"], b["k_scale"]),
                   v_cache=dequantize_fp8(b["v_cache"], b["v_scale"]), k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(reference(b), reference(widened), atol=1e-6, rtol=1e-6)


# ---- the kernels against the reference ---------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 16, 8), (3, 64, 16), (4, 16, 32)])
def test_decode_kernel_equals_reference(group, head_dim, block_size, fp8, qdtype):
    b, _, _ = fp8_batch(DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), fp8, qdtype, group=group,
                        head_dim=head_dim, block_size=block_size)
    out = pa.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                    b["seq_lens"], b["scale"], k_scale=b["k_scale"], v_scale=b["v_scale"])
    assert_close(out, reference(b), qdtype)


@needs_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 16, 8), (2, 64, 16), (3, 16, 32)])
def test_prefill_kernel_equals_reference_on_a_mixed_batch(group, head_dim, block_size, fp8, qdtype):
    b, _, _ = fp8_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, fp8, qdtype, group=group,
                        head_dim=head_dim, block_size=block_size)
    out = pa.paged_attention_prefill(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                     b["query_start_loc"], b["seq_lens"], b["scale"],
                                     k_scale=b["k_scale"], v_scale=b["v_scale"])
    assert_close(out, reference(b), qdtype)


@needs_triton
@pytest.mark.parametrize("window", [None, 5])
def test_dispatcher_and_sliding_window_with_fp8(window):
    for seq_lens, query_lens in ((DECODE_SEQ_LENS, [1] * 4), (MIXED_SEQ_LENS, MIXED_QUERY_LENS)):
        b, _, _ = fp8_batch(seq_lens, query_lens, torch.float8_e4m3fn, group=2, block_size=8)
        out = pa.paged_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                 b["query_start_loc"], b["seq_lens"], b["scale"], window,
                                 k_scale=b["k_scale"], v_scale=b["v_scale"])
        assert_close(out, reference(b, window), torch.float32)


@needs_triton
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_e4m3_byte_decoding_path_equals_reference(monkeypatch, kind):
    """The path for GPUs whose Triton has no e4m3 type: the pool goes in as bytes and the
    kernel decodes sign, exponent and mantissa itself. Forced here on the interpreter."""
    monkeypatch.setattr(pa, "triton_has_e4m3", lambda device: False)
    seq_lens, query_lens = ((DECODE_SEQ_LENS, [1] * 4) if kind == "decode"
                            else (MIXED_SEQ_LENS, MIXED_QUERY_LENS))
    b, _, _ = fp8_batch(seq_lens, query_lens, torch.float8_e4m3fn, group=2, block_size=16)
    assert pa._kv_operands(b["k_cache"], b["v_cache"])[2] is True
    out = pa.paged_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                             b["query_start_loc"], b["seq_lens"], b["scale"],
                             k_scale=b["k_scale"], v_scale=b["v_scale"])
    assert_close(out, reference(b), torch.float32)


@needs_triton
def test_e4m3_byte_decoding_is_exact_for_every_finite_value():
    """All 254 finite e4m3 bit patterns (normals, subnormals, zeros) decode exactly: one
    block holds them all as keys, and the values are one-hot, so attention over a single
    key returns that key's value. Checked directly on the decoder through a tiny kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode_bytes(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, pa._e4m3_from_bits(tl.load(x_ptr + i)))

    bits = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    decode_bytes[(1,)](bits, out, N=256)
    want = bits.view(torch.float8_e4m3fn).float()
    finite = want.isfinite()
    assert finite.sum() == 254
    assert torch.equal(out[finite], want[finite])
    assert torch.equal(out[finite].sign(), want[finite].sign())


# ---- bad input -------------------------------------------------------------------------------------

@needs_triton
def test_bad_scales_and_fp8_queries_are_refused():
    b, _, _ = fp8_batch([5], [1], torch.float8_e4m3fn, head_dim=16, block_size=8)
    args = (b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"])
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
            pa.paged_attention_decode(b["q"], *args, k_scale=bad)
        with pytest.raises(ValueError, match="v_scale must be a positive finite number"):
            pa.paged_attention_decode(b["q"], *args, v_scale=bad)
    with pytest.raises(TypeError, match="only the cache may be fp8"):
        pa.paged_attention_decode(b["q"].to(torch.float8_e4m3fn), *args)
    with pytest.raises(AssertionError, match="share a dtype"):
        pa.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"].to(torch.float8_e5m2),
                                  *args[2:])
