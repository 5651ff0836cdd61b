"""The weight-only kernels a GPU decodes with: W8A16 (llmopt/kernels/fp8_matmul.py) against its
reference under TRITON_INTERPRET=1, and tinygemm's int4 operands (llmopt/layers/quant/cuda_int4.py)
against the GPTQ / AWQ weights they repack; the CUDA op itself is checked on a GPU (marked cuda)."""

import pytest
import torch
from test_quant_kernels import random_weight
from triton_checks import DEVICE, DTYPES, needs_triton

from llmopt.kernels.split_k import k_per_split, split_k
from llmopt.layers.quant.awq import AWQLinear
from llmopt.layers.quant.cuda_int4 import (act_order_permutation, tinygemm_dequantize, tinygemm_fits,
                                          tinygemm_operands)
from llmopt.layers.quant.gptq import GPTQLinear


def fp8_case(M, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE)
    return x, w, (torch.rand(N, generator=g) * 0.01 + 1e-3).to(DEVICE), torch.randn(N, generator=g).to(DEVICE, dtype)


@needs_triton
@pytest.mark.parametrize("M,K,N", [(1, 128, 64), (5, 256, 96), (33, 192, 130)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_weight_kernel_equals_reference(M, K, N, dtype):
    from llmopt.kernels.fp8_matmul import fp8_weight_matmul, fp8_weight_matmul_ref

    x, w, s, bias = fp8_case(M, K, N, dtype, seed=M)
    for b, split in ((None, None), (bias, None), (bias, 1), (None, 3), (bias, 3)):
        got = fp8_weight_matmul(x, w, s, b, split=split)
        want = fp8_weight_matmul_ref(x, w, s, b)
        assert got.dtype == dtype and got.shape == (M, N)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
    out = fp8_weight_matmul(x, w, s, bias, out_dtype=torch.float32)
    assert out.dtype == torch.float32


def test_split_k_fills_the_machine_only_for_few_rows():
    assert split_k(64, 8192, 8192, 64, 64, "cpu") == 1          # enough row tiles already
    assert split_k(1, 128, 8192, 64, 64, "cpu") == 2              # 2 tiles: 4 programs on the stand-in
    assert split_k(1, 64, 256, 64, 64, "cpu") == 1                # too few K tiles to share
    assert k_per_split(100, 3, 32) == 64 and k_per_split(128, 2, 32) == 64


@pytest.mark.parametrize("layout,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_tinygemm_operands_hold_the_checkpoints_weight(layout, act_order):
    """Repacked for tinygemm ((q - 8) * scale + zero, two columns a byte, act-order columns sorted by
    group), the weight is the checkpoint's, up to the scales' and zeros' rounding to bfloat16."""
    K, N, G = 256, 96, 64
    m = (GPTQLinear if layout == "gptq" else AWQLinear).from_quantized(random_weight(K, N, G, act_order, seed=3))
    q, scale, zero, g_idx = m.affine()
    perm = None if g_idx is None else act_order_permutation(g_idx, G)
    assert (perm is not None) == act_order
    if perm is not None:
        assert torch.equal(g_idx.long()[perm], torch.arange(K) // G)  # groups consecutive after sorting
        q = q[:, perm]
    scale = scale.float()
    nibbles, sz = tinygemm_operands(q, scale, scale * (8 - zero.float()))
    assert nibbles.shape == (N, K // 2) and nibbles.dtype == torch.uint8 and sz.shape == (K // G, N, 2)
    assert torch.equal((nibbles >> 4).int(), q[:, 0::2]) and torch.equal((nibbles & 15).int(), q[:, 1::2])
    got = tinygemm_dequantize(nibbles, sz)
    want = m.dequantize(torch.float32)
    want = want if perm is None else want[:, perm]
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


def test_tinygemm_says_why_not():
    assert tinygemm_fits(96, 256, 64, torch.bfloat16, "cpu") == "tinygemm is a CUDA kernel"
    with pytest.raises(ValueError, match="in every group"):
        act_order_permutation(torch.tensor([0, 0, 0, 1]), 2)


@pytest.mark.cuda
@pytest.mark.parametrize("layout,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
@pytest.mark.parametrize("M", [1, 7, 64])
def test_tinygemm_on_the_gpu_equals_the_triton_kernel_and_the_reference(layout, act_order, M):
    K, N, G = 576, 960, 64  # SmolLM2's qkv_proj (576 = 64 x 9: two 16-column tiles a pass)
    w = random_weight(K, N, G, act_order, seed=M)
    m = (GPTQLinear if layout == "gptq" else AWQLinear).from_quantized(w, dtype=torch.bfloat16).cuda()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ m.dequantize(torch.float32).t()
    got = m(x)
    assert m.tinygemm(torch.bfloat16) is not None
    m.cuda_kernel = "triton"
    triton_out = m(x)
    for out in (got, triton_out):
        torch.testing.assert_close(out.float(), want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)
