"""The C++ dense matmul kernels (llmopt/kernels/cpu/dense_matmul.cpp and dense_panels.cpp) against
the float64 product: the row kernel for a few rows of bf16 or float32 weights, and bf16 weights
repacked in panels of 32 rows for any number of rows; bad inputs refused with what was expected."""

import pytest
import torch

from llmopt.kernels import cpu

needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"no C++ CPU kernels: {cpu.why_unavailable()}")
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


# ---- dense weights at a few rows (the decode step's matrix-vector kernel) ---------------------------

@needs_kernels
@pytest.mark.parametrize("w_dtype,x_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float32)])
@pytest.mark.parametrize("rows,k", [(1, 576), (3, 576), (5, 100), (9, 1536), (2, 7)])
def test_dense_matmul_equals_the_float64_product(w_dtype, x_dtype, rows, k):
    """Every row of x against every weight row, K with and without a vector-width tail, M across
    the kernel's passes of 4 rows; the sum in float32, the result in x's dtype."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    w, x = torch.randn(67, k, generator=g).to(w_dtype), torch.randn(rows, k, generator=g).to(x_dtype)
    got = cpu.load().dense_matmul(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == x_dtype and got.shape == (rows, 67)
    tol = TOL[x_dtype] * want.abs().max().item() + 1e-4
    assert (got.double() - want).abs().max().item() <= tol


needs_panels = pytest.mark.skipif(not cpu.available() or not cpu.load().dense_panels_supported(),
                                  reason="bf16 weight panels need an AVX-512 build")


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("k", [576, 34, 2])
def test_dense_panels_equal_the_float64_product(rows, k):
    """bf16 panels of 32 rows (dense_panels.cpp): rows of x in tiles of 8 and their tails, one row
    with its split accumulators, K down to one pair of columns; the result rounded to bf16."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    w, x = torch.randn(96, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    panels = cpu.dense_panels(w)
    assert panels.shape == (3, k // 2, 2, 16, 2)
    got = cpu.load().dense_matmul(x, panels)
    want = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert (got.double() - want).abs().max().item() <= TOL[torch.bfloat16] * want.abs().max().item() + 1e-4
    # rounded once, to nearest even: the float32 sum's bf16, which the row kernel also returns
    assert (got == cpu.load().dense_matmul(x.float(), w).bfloat16()).float().mean() > 0.97


@needs_panels
def test_dense_panels_only_where_they_apply():
    assert cpu.dense_panels(torch.randn(48, 64).bfloat16()) is None   # rows not a multiple of 32
    assert cpu.dense_panels(torch.randn(32, 7).bfloat16()) is None    # an odd number of columns
    assert cpu.dense_panels(torch.randn(32, 64)) is None              # float32 stays on torch's matmul
    panels = cpu.dense_panels(torch.randn(32, 64).bfloat16())
    with pytest.raises(ValueError, match="x must be bfloat16 .M, 64."):
        cpu.load().dense_matmul(torch.randn(1, 64), panels)
    with pytest.raises(ValueError, match="panel weights must be contiguous bfloat16"):
        cpu.load().dense_matmul(torch.randn(1, 64).bfloat16(), panels.half())


@needs_kernels
def test_bad_dense_matmul_inputs_are_refused():
    with pytest.raises(ValueError, match="x must be .M, K. and w .N, K."):
        cpu.load().dense_matmul(torch.randn(1, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="w must be bfloat16 or float32"):
        cpu.load().dense_matmul(torch.randn(1, 8), torch.randn(4, 8).half())
