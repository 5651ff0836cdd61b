"""FP8: 8-bit floating point numbers, and the scales that make them usable.

An FP8 value is a sign, a few exponent bits and a few mantissa bits. Two layouts are in
use (the OCP "FP8 formats for deep learning" spec, as NVIDIA Hopper/Ada implement it):

- e4m3 ("e4m3fn": finite, no infinities): 4 exponent bits, 3 mantissa bits, largest
  value 448. More precision, less range: weights, activations and the KV cache.
- e5m2: 5 exponent bits, 2 mantissa bits, largest finite value 57344 (it keeps
  infinities, like IEEE half). More range, less precision: gradients in training.

A tensor's values rarely sit in that range on their own, so FP8 always travels with a
scale: store q = fp8(clamp(x / scale)), read back x ~ q * scale. The scale maps the
tensor's largest magnitude (its amax) onto the format's largest value, so that the
whole grid is used. The clamp is not optional: a cast past the largest finite value gives
inf in e5m2, and NaN in e4m3fn (which has no infinity) wherever the conversion does not
saturate; torch's own e4m3fn cast saturates, a hardware conversion without `.satfinite`
does not. Clamping first makes every path store the same bytes.

Scales can be per tensor (one number: KV cache, activations in static schemes), per
output channel (one per weight row) or per token (one per activation row, computed on
the fly: "dynamic" activation quantization).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """The constants of one FP8 layout (what `torch.finfo` reports, plus the bit layout)."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    max: float            # largest finite value
    min_normal: float     # smallest positive value with an implicit leading 1
    min_subnormal: float  # smallest positive value at all: 2^(1 - bias - mantissa_bits)
    has_inf: bool

    @property
    def num_finite_values(self) -> int:
        return int(fp8_values(self.dtype).numel())


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, exponent_bits=4, mantissa_bits=3, exponent_bias=7,
                 max=448.0, min_normal=2.0 ** -6, min_subnormal=2.0 ** -9, has_inf=False)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, exponent_bits=5, mantissa_bits=2, exponent_bias=15,
                 max=57344.0, min_normal=2.0 ** -14, min_subnormal=2.0 ** -16, has_inf=True)

FP8_E4M3_MAX = E4M3.max
FP8_E5M2_MAX = E5M2.max
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# The KV cache dtypes the engine accepts, spelled as vLLM spells them ("fp8" is e4m3).
KV_CACHE_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                       "fp8_e5m2": torch.float8_e5m2}


def fp8_format(dtype: torch.dtype | str) -> FP8Format:
    """The format of a torch float8 dtype or of a name ("e4m3", "fp8_e5m2", "fp8", ...)."""
    if isinstance(dtype, str):
        key = dtype.removeprefix("fp8_").removeprefix("float8_")
        key = {"fp8": "e4m3", "e4m3fn": "e4m3"}.get(key, key)
        if key == "e4m3":
            return E4M3
        if key == "e5m2":
            return E5M2
        raise ValueError(f"unknown FP8 format {dtype!r}; allowed: 'e4m3' (= 'fp8', 'fp8_e4m3'), 'e5m2'")
    if dtype == torch.float8_e4m3fn:
        return E4M3
    if dtype == torch.float8_e5m2:
        return E5M2
    raise ValueError(f"{dtype} is not an FP8 dtype; allowed: torch.float8_e4m3fn, torch.float8_e5m2")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


# A zero amax (an all-zero tensor or row) would give a zero scale and 0 / 0 = NaN on the
# way in. vLLM floors dynamic scales at 1 / (fp8 max * 512); we floor every scale there.
def min_scale(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    return 1.0 / (fp8_format(dtype).max * 512.0)


# -- scales from amax --------------------------------------------------------------------------
def scale_from_amax(amax: torch.Tensor | float, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The scale that maps `amax` onto the format's largest value: amax / fp8_max (floored)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return (amax.float() / fp8_format(dtype).max).clamp(min=min_scale(dtype))


def per_tensor_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """One fp32 scale for the whole tensor (a 0-d tensor)."""
    return scale_from_amax(x.detach().abs().amax().float(), dtype)


def per_channel_scale(w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """One scale per output channel of a weight [out_features, in_features]: shape [out, 1].

    (llm-compressor's "channel" strategy; its `weight_scale` is stored in this shape.)
    """
    if w.dim() != 2:
        raise ValueError(f"per_channel_scale expects a 2-D weight [out, in], got shape {tuple(w.shape)}")
    return scale_from_amax(w.detach().abs().amax(dim=1, keepdim=True).float(), dtype)


def per_token_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """One scale per row (token) over the last dimension: shape [..., 1]. Computed on the fly
    for activations ("dynamic" quantization), so each token uses the full FP8 range."""
    return scale_from_amax(x.detach().abs().amax(dim=-1, keepdim=True).float(), dtype)


# -- the casts ---------------------------------------------------------------------------------
def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float,
                 dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """fp8(clamp(x / scale, -max, max)): divide in fp32, clamp to the finite range, round to
    nearest even. `scale` broadcasts against `x` (a number, [out, 1], [tokens, 1], ...)."""
    fmt = fp8_format(dtype)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale, in fp32, then cast to `dtype`. Every FP8 value is exact in fp32 (and in
    bf16/fp16), so the only rounding on the way back is the final cast."""
    if not is_fp8(q.dtype):
        raise TypeError(f"dequantize_fp8 expects a float8 tensor, got {q.dtype}")
    scale = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.float() * scale).to(dtype)


def quantize_fp8_per_tensor(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """(q, scale) with one scale for the whole tensor."""
    scale = per_tensor_scale(x, dtype)
    return quantize_fp8(x, scale, dtype), scale


def quantize_fp8_per_channel(w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """(q, scale [out, 1]) for a weight [out, in]."""
    scale = per_channel_scale(w, dtype)
    return quantize_fp8(w, scale, dtype), scale


def quantize_fp8_per_token(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """(q, scale [..., 1]) with one scale per row of the last dimension."""
    scale = per_token_scale(x, dtype)
    return quantize_fp8(x, scale, dtype), scale


# -- the value grid (lesson 07 draws it) ---------------------------------------------------------
def fp8_values(dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Every finite value of the format, sorted, in fp32 (all 256 bit patterns, decoded)."""
    fmt = fp8_format(dtype)
    v = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    return torch.unique(v[torch.isfinite(v)]) + 0.0  # +0 and -0 are one value (+ 0.0: printed as 0)


def fp8_neighbours(x: float, dtype: torch.dtype = torch.float8_e4m3fn) -> dict:
    """For a real number x: the representable values just below and above it, the one the
    cast picks (after clamping), and the error. What the lesson's value picker shows."""
    fmt = fp8_format(dtype)
    grid = fp8_values(dtype)
    xc = min(max(float(x), -fmt.max), fmt.max)
    i = int(torch.searchsorted(grid, torch.tensor(xc)))
    below = float(grid[max(i - 1, 0)]) if i == len(grid) or float(grid[i]) != xc else xc
    above = float(grid[min(i, len(grid) - 1)])
    rounded = float(torch.tensor([x], dtype=torch.float32).clamp(-fmt.max, fmt.max).to(fmt.dtype).float())
    err = rounded - float(x)
    return {"x": float(x), "below": below, "above": above, "rounded": rounded, "error": err,
            "relative_error": abs(err) / abs(x) if x else 0.0}


# -- where FP8 runs natively -------------------------------------------------------------------------
# FP8 tensor cores arrive with Ada (compute capability 8.9), and with them Triton's e4m3 type.
FP8_COMPUTE_CAPABILITY = (8, 9)
logger = logging.getLogger(__name__)


def fp8_compute_supported(device_type: str, capability: tuple[int, int] | None) -> bool:
    """True where FP8 is computed with (`torch._scaled_mm`, Triton's e4m3 type): CUDA from compute
    capability 8.9. Elsewhere FP8 is only stored: the weights and the KV cache stay in fp8 and are
    widened to the model's dtype for the math (vLLM's weight-only FP8 on such GPUs); a GPU there
    says so once. Decided from the arguments alone (no device is asked), so any GPU is testable."""
    if device_type != "cuda" or capability is None:
        return False
    if tuple(capability) >= FP8_COMPUTE_CAPABILITY:
        return True
    _notice_fp8_storage_only(tuple(capability))
    return False


@functools.cache
def _notice_fp8_storage_only(capability: tuple[int, int]) -> None:
    logger.warning("FP8 is stored but multiplied in 16 bits on this GPU: compute capability %d.%d has no "
                   "FP8 tensor cores (they need >= 8.9), so FP8 weights and KV cache are widened to the "
                   "model's dtype for the math (weight-only FP8, as vLLM runs it there): memory saved, "
                   "not arithmetic", *capability)


def native_fp8_supported(device: torch.device | str | None = None) -> bool:
    """`fp8_compute_supported` for a device of this machine (the current GPU by default): True
    on CUDA devices with FP8 tensor cores (Ada, Hopper, Blackwell)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    return fp8_compute_supported(device.type, torch.cuda.get_device_capability(device) if on_cuda else None)
