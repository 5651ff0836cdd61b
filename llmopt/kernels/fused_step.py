"""The decode step's elementwise work, one kernel per piece, for the GPU's recorded step.

A decoder layer of the eager model launches about thirty elementwise kernels besides its four
matrix products: RMSNorm alone is a cast, a square, a mean, an add, an rsqrt, two multiplies;
RoPE a multiply, a flip, a multiply and an add for q and again for k. On a GPU each kernel costs
a few microseconds however little it does, so at batch 1 they, not the weights, set the step
time even inside a CUDA graph (which removes the launches' CPU cost, not the kernels'). These
kernels do each piece in one pass over registers (vLLM's fused_add_rms_norm, rotary_embedding and
silu_and_mul; gpt-fast gets the same from torch.compile):

    add_rms_norm  s = x + residual (the residual stream), then RMSNorm(s) * weight: one kernel
                  for the layer's add and the next norm
    rotary        q and k turned by their positions' angles, from the model's own cos / sin tables
    silu_mul      silu(gate) * up over the gate_up product's two halves

Each rounds to the model's dtype where the eager layer does, so the step through them is the
eager step within float32's last bits (llmopt/kernels/fused_step_ref.py says the meaning; the
tests hold the kernels to it and it to the layers).
"""

from __future__ import annotations

import torch

from llmopt.kernels import HAS_TRITON
from llmopt.kernels.fused_step_ref import add_rms_norm_ref, rotary_ref, silu_mul_ref  # noqa: F401  (the meaning)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, s_ptr, H, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row; the row fits one block (hidden sizes are a few thousand at most)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * H + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded, as the eager add is
            tl.store(s_ptr + row * H + cols, x, mask=mask)
        xf = x.to(tl.float32)
        y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * H + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_tok, stride_head, HEAD_DIM: tl.constexpr):
        # one program per (token, head): the head's halves x1, x2 and its position's table rows
        tok, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        half = tl.arange(0, HEAD_DIM // 2)
        base = x_ptr + tok * stride_tok + head * stride_head
        x1 = tl.load(base + half)
        x2 = tl.load(base + HEAD_DIM // 2 + half)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        dt = x1.dtype
        c1 = tl.load(cos_ptr + pos * HEAD_DIM + half).to(dt).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * HEAD_DIM + HEAD_DIM // 2 + half).to(dt).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * HEAD_DIM + half).to(dt).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * HEAD_DIM + HEAD_DIM // 2 + half).to(dt).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + [x2, x1] * signed_sin, each product rounded as the eager multiplies are
        o1 = ((a1 * c1).to(dt).to(tl.float32) + (a2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
        out = out_ptr + (tok * tl.num_programs(1) + head) * HEAD_DIM
        tl.store(out + half, o1)
        tl.store(out + HEAD_DIM // 2 + half, o2)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * inter + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` in one kernel: rows [T, H] (contiguous) -> (normed, s)."""
    T, H = x.shape
    assert x.is_contiguous() and weight.shape == (H,), "x: contiguous [T, H]; weight: [H]"
    out = torch.empty_like(x)
    s = x if residual is None else torch.empty_like(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
    _add_rms_norm_kernel[(T,)](x, x if residual is None else residual, weight, out, s, H, float(eps),
                               HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(H))
    return out, s


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_ref` in one kernel each for q and k (which may be strided views of the qkv
    product: a head's features contiguous); returns new contiguous tensors."""
    D = q.shape[-1]
    assert D % 2 == 0 and D & (D - 1) == 0, f"head_dim {D}: a power of two (the kernel's halves are blocks)"
    assert cos.is_contiguous() and signed_sin.is_contiguous() and cos.shape[-1] == D
    outs = []
    for x in (q, k):
        assert x.stride(-1) == 1, "a head's features must be contiguous"
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _rotary_kernel[(x.shape[0], x.shape[1])](x, out, positions, cos, signed_sin, x.stride(0), x.stride(1),
                                                 HEAD_DIM=D)
        outs.append(out)
    return outs[0], outs[1]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_ref` in one kernel: [T, 2I] (contiguous) -> [T, I]."""
    T, two_i = gate_up.shape
    assert gate_up.is_contiguous() and two_i % 2 == 0
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
