"""The decode step's fused elementwise kernels (llmopt/kernels/fused_step.py) against their torch
meaning (fused_step_ref.py), and that meaning against the model's own layers."""

import pytest
import torch

from llmopt.layers.norm import RMSNorm
from llmopt.layers.rotary import RotaryEmbedding
from tests.triton_checks import DEVICE, DTYPES, needs_triton


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def test_references_are_the_layers():
    from llmopt.kernels.fused_step_ref import add_rms_norm_ref, rotary_ref, silu_mul_ref

    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=g)
    out, s = add_rms_norm_ref(x, norm.weight, 1e-5, r)
    assert torch.equal(s, x + r) and torch.equal(out, norm(x + r))
    assert torch.equal(add_rms_norm_ref(x, norm.weight, 1e-5)[0], norm(x))
    rope = RotaryEmbedding(32, 256, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    pos = torch.tensor([0, 7, 200, 3, 3])
    q, k = torch.randn(5, 4, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    want = rope(pos, q, k)
    got = rotary_ref(pos, q, k, rope.cos, rope.signed_sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gu = torch.randn(3, 2 * 48, generator=g)
    assert torch.equal(silu_mul_ref(gu), torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_add_rms_norm_kernel(dtype, hidden):
    from llmopt.kernels.fused_step import add_rms_norm, add_rms_norm_ref

    g = torch.Generator().manual_seed(hidden)
    x, r = (torch.randn(6, hidden, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(DEVICE, dtype)
    for residual in (None, r):
        out, s = add_rms_norm(x, w, 1e-6, residual)
        want_out, want_s = add_rms_norm_ref(x, w, 1e-6, residual)
        assert torch.equal(s, want_s)  # the add is exact in float32, then rounded once: bit for bit
        torch.testing.assert_close(out, want_out, **tol(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kernel_on_views_of_the_qkv_product(dtype):
    from llmopt.kernels.fused_step import rotary, rotary_ref

    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, 512, 500000.0)
    T, hq, hk, D = 7, 8, 2, 64
    qkv = torch.randn(T, (hq + 2 * hk) * D, generator=g).to(DEVICE, dtype)
    q, k, _ = qkv.split([hq * D, hk * D, hk * D], dim=-1)
    q, k = q.view(T, hq, D), k.view(T, hk, D)  # strided views, as the attention layer splits them
    pos = torch.tensor([0, 1, 2, 100, 511, 37, 37]).to(DEVICE)
    cos, sin = rope.cos.to(DEVICE), rope.signed_sin.to(DEVICE)
    got, want = rotary(pos, q, k, cos, sin), rotary_ref(pos, q, k, cos, sin)
    for a, b in zip(got, want):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, **tol(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1536, 2500])
def test_silu_mul_kernel(dtype, inter):
    from llmopt.kernels.fused_step import silu_mul, silu_mul_ref

    gu = (3 * torch.randn(4, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(DEVICE, dtype)
    torch.testing.assert_close(silu_mul(gu), silu_mul_ref(gu), **tol(dtype))
