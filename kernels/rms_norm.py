"""RMSNorm as a Triton kernel: one program normalizes one row (token).

The reference is `rms_norm_ref`; `tests/test_kernels.py` holds them equal. A warm-up
kernel for the course: it shows the Triton shape every later kernel shares (a program
id picks the work, `tl.arange` spans a block, masked loads and stores handle the edges).
"""

from __future__ import annotations

import torch

from llmopt.kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (x * inv_rms).to(w.dtype) * w
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    n_cols = shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n_cols, eps,
                                     BLOCK=triton.next_power_of_2(n_cols))
    return out.reshape(shape)
