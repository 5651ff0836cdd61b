"""The plain-torch meaning of the decode step's fused elementwise kernels (llmopt/kernels/fused_step.py):
the same arithmetic as the model's own layers (llmopt/layers/norm.py, rotary.py, llama.py's MLP),
rounded to the model's dtype at the same points, so that a step through the kernels reads as the
eager step does. The kernels are tested against these, and these against the layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s) * weight, s) with s = x + residual (rounded to x's dtype, as the eager add
    is), or s = x without a residual. Rows [T, H]; the norm is computed in float32."""
    s = x if residual is None else x + residual
    y = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(s.dtype), s


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE, "rotate half" layout: x * cos + [x2, x1] * signed_sin, the tables' rows [max_pos, D]
    looked up by position and rounded to q's dtype. q [T, Hq, D], k [T, Hk, D] -> new tensors."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = signed_sin[positions].unsqueeze(1).to(q.dtype)

    def turn(x):
        return x * c + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * s
    return turn(q), turn(k)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle: silu(gate) * up, gate and up the two halves of each row [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
