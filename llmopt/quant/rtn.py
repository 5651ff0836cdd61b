"""Round-to-nearest (RTN): the quantization grid every method here shares, and the baseline.

A group of weights w (one row's `group_size` consecutive input columns) is mapped onto
2^bits evenly spaced levels:

    scale = (max - min) / (2^bits - 1)        zero = round(-min / scale)
    q     = clamp(round(w / scale) + zero, 0, 2^bits - 1)
    w_hat = scale * (q - zero)

with min <= 0 <= max, so that 0 is exactly representable (as GPTQ's quantizer does).
Symmetric quantization fixes zero = 2^(bits-1) and scale = 2 max|w| / (2^bits - 1).
Scales are rounded to float16 when they are made, because that is how checkpoints store
them: the integers chosen here are then exactly the ones that dequantize correctly.

RTN looks at nothing but the weights. GPTQ and AWQ use the same grid but choose better
integers (GPTQ) or better weights to round (AWQ), using calibration activations.
"""

from __future__ import annotations

import torch

from llmopt.layers.quant.formats import QuantizedWeight


def quant_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16-representable, as fp32) and integer zero for each row of w [..., n], over its last dim.

    min_zero=1 keeps zero points >= 1, for the GPTQ v1 layout, which stores zero - 1.
    """
    maxq = (1 << bits) - 1
    w = w.float()
    xmin = w.amin(-1).clamp(max=0)
    xmax = w.amax(-1).clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)  # an all-zero group: any scale works, avoid 0 / 0
    xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
    scale = ((xmax - xmin) / maxq).half().float().clamp(min=2.0 ** -24)  # fp16's smallest step
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / scale).clamp(min_zero, maxq)
    return scale, zero.to(torch.int32)


def search_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0, norm: float = 2.4,
                  grid: int = 100, max_shrink: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_params over a clipped range: for p = 1, 1 - 1/grid, ... down to 1 - max_shrink, the grid
    of [p min, p max]; per row, the p whose rounding error sum |w - w_hat|^norm is least (the GPTQ
    authors' `mse` search, their defaults). Clipping a group's one large weight costs that weight,
    and every other weight of the group gets a finer grid."""
    w = w.float()
    best_scale, best_zero = quant_params(w, bits, sym, min_zero)
    best = _error(w, best_scale, best_zero, bits, norm)
    for i in range(1, int(max_shrink * grid) + 1):
        scale, zero = quant_params(w * (1 - i / grid), bits, sym, min_zero)   # the range [p min, p max]
        err = _error(w, scale, zero, bits, norm)
        better = err < best
        best = torch.where(better, err, best)
        best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _error(w, scale, zero, bits, norm) -> torch.Tensor:
    q = quantize_to_grid(w, scale[..., None], zero[..., None], bits)
    return (w - scale[..., None] * (q - zero[..., None])).abs().pow(norm).sum(-1)


def quantize_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes q = clamp(round(w / scale) + zero, 0, 2^bits - 1); scale and zero broadcast."""
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, (1 << bits) - 1).to(torch.int32)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0) -> torch.Tensor:
    """w [out, in] -> its RTN-quantized values, dequantized again (same shape and dtype)."""
    return rtn_quantize(w, bits, group_size, sym, min_zero).dequantize(w.dtype)


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                 min_zero: int = 0) -> QuantizedWeight:
    """Group-wise RTN of a weight [out, in]; group_size -1 is one group per row (per channel)."""
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    groups = weight.float().reshape(n, k // g, g)
    scale, zero = quant_params(groups, bits, sym, min_zero)                  # [out, k / g]
    q = quantize_to_grid(groups, scale[..., None], zero[..., None], bits).reshape(n, k)
    g_idx = torch.arange(k, device=weight.device, dtype=torch.int32) // g
    return QuantizedWeight(q, scale.t().half(), zero.t().contiguous(), g_idx, bits, group_size)
