"""W8A16: float8 weights, 16-bit activations, for decode batch sizes on a GPU.

At a few rows a product reads every weight once and does two flops with each: its time is the
weights' bytes. An FP8 weight is half a bf16 one, so the product should take half the time, if the
kernel streams the fp8 bytes and widens them in registers. The W8A8 path (`torch._scaled_mm`,
llmopt/fp8/linear.py) is the right one for many rows, where FP8 tensor cores double the flops;
at one row it first rounds the activations to fp8 (two more kernels) and runs a GEMM tiled for
large products. Here instead each program loads a tile of fp8 weights [BLOCK_K, BLOCK_N], widens
it exactly to the activations' dtype (every e4m3 value is a bf16 and an fp16 value), and feeds
`tl.dot`; the per-output-channel scale multiplies the float32 sum once, at the end:

    out[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n]        (w float8_e4m3fn [N, K])

The inputs are split among programs when the rows are few (llmopt/kernels/split_k.py).
`fp8_weight_matmul_ref` says it in torch.
"""

from __future__ import annotations

import torch

from llmopt.kernels import HAS_TRITON
from llmopt.kernels.split_k import k_per_split, reduce_partials, split_k


def fp8_weight_matmul_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (w [N, K] float8 * scale [N]).T (+ bias), summed in float32, out in x's dtype."""
    out = (x.float() @ w.float().t()) * scale.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(x.dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_weight_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, k_split,
                           stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * k_split, tl.minimum(K, (pid_k + 1) * k_split), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        if not SPLIT:  # one slice: scale and bias here; else split_k.reduce_partials applies them
            acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptr += pid_k * M * N
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_weight_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      split: int | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_weight_matmul_ref` tile by tile: x [M, K] (bf16, fp16 or fp32), w [N, K] float8_e4m3fn,
    scale [N] (or [N, 1]) float32; `split` slices of K (None: as many as M needs); the output in
    `out_dtype` (None: x's)."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and w.dtype == torch.float8_e4m3fn, "w: float8_e4m3fn [N, K]"
    scale = scale.reshape(-1).float().contiguous()
    BLOCK_M = 16 if M <= 16 else 32 if M <= 32 else 64
    BLOCK_N, BLOCK_K = 64, 64
    split = split_k(M, N, K, BLOCK_N, BLOCK_K, x.device) if split is None else split
    out_dtype = out_dtype or x.dtype
    out = torch.empty(M, N, dtype=out_dtype, device=x.device) if split == 1 else \
        torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), split)
    _fp8_weight_kernel[grid](x, w, scale, bias if bias is not None else scale, out, M, N, K,
                             k_per_split(K, split, BLOCK_K), x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                             out.stride(-2), out.stride(-1), HAS_BIAS=bias is not None, SPLIT=split > 1,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return out if split == 1 else reduce_partials(out, out_dtype, scale, bias)
