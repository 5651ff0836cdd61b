"""CPU weight-only int8 / int4 matmuls: the weights stay integers, the activations do not.

At batch 1 a decoder step reads every weight once and does two flops with each, so its
speed is the speed of reading weights: an int4 weight is a quarter of a bf16 one. PyTorch
ships two CPU kernels for this (what gpt-fast runs on a CPU), and this module wraps them:

- `torch.ops.aten._weight_int8pack_mm(x, q, scales)`: q int8 [N, K], one scale per output
  channel (a vector [N] in x's dtype); y = x @ (q * scales[:, None]).T.
- `torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)`:
  `packed` is what `_convert_weight_to_int4pack_for_cpu(q, 1)` makes of q int32 [N, K]
  with values in [0, 16) (N must be a multiple of 16); `scales_and_zeros` is
  [K / group_size, N, 2] in x's dtype, and the weight it multiplies by is

      W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n],  g = k // group_size,

  group_size one of 32, 64, 128, 256. Every affine 4-bit format maps onto this exactly up to
  the scales' rounding to x's dtype: GPTQ / AWQ's scale * (q - z) has zero = scale * (8 - z);
  GGUF Q4_1's d * q + m has zero = m + 8 d; Q4_0's d * (q - 8) has zero = 0.

Measured against torch's dense bf16 matmul (benchmarks/README.md, "Measurements behind the
code's choices"), the kernels win only on bf16 (or fp16) activations and a few rows: decode at
small batch (fp32 activations take a slow generic path). Above `KERNEL_MAX_ROWS` rows (prefill,
large decode batches) the layer multiplies by a dense copy made once from the same integers, the
path the kernels are tested against.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_MAX_ROWS = 4   # at 16 rows the dense bf16 matmul is faster (measured: benchmarks/README.md)


def int4_kernel_fits(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why torch's int4 CPU kernel cannot run this shape (None when it can)."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} (the int4 kernel takes {INT4_GROUP_SIZES})"
    if in_features % group_size:
        return f"in_features {in_features} not a multiple of the group size {group_size}"
    if out_features % 16:
        return f"out_features {out_features} not a multiple of 16"
    return None


def int4_zero(scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """GPTQ / AWQ's W = scale * (q - zero_point) in the kernels' form (q - 8) * scale + zero."""
    return scale.float() * (8 - zero_point.float())


def int4_scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale and zero [K / G, N] -> the kernels' scales_and_zeros [K / G, N, 2] in `dtype`."""
    return torch.stack([scale.float(), zero.float()], -1).to(dtype).contiguous()


def int4_dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in float32 that (q - 8) * scale + zero gives, q [N, K] in [0, 16)."""
    s, z = scales_and_zeros.float().unbind(-1)                          # [G, N] each
    group = q.shape[1] // s.shape[0]
    return (q.float() - 8) * s.repeat_interleave(group, 0).t() + z.repeat_interleave(group, 0).t()


class Int4Weight:
    """A [N, K] weight as torch's CPU int4 kernel wants it: packed nibbles + scales and zeros."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
        """q [N, K] integers in [0, 16); scale, zero [K / G, N]: W = (q - 8) * scale + zero."""
        n, k = q.shape
        self.out_features, self.in_features = n, k
        self.group_size = k // scale.shape[0]
        why = int4_kernel_fits(n, k, self.group_size)
        if why is not None:
            raise ValueError(f"torch's int4 CPU kernel cannot run a [{n}, {k}] weight: {why}")
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"the int4 CPU kernel runs {KERNEL_DTYPES} activations, not {dtype}")
        self.dtype = dtype
        q8 = q.to(torch.uint8)
        self.nibbles = q8[:, 0::2] | (q8[:, 1::2] << 4)   # for dequantize(): the kernel's packing is opaque
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = int4_scales_and_zeros(scale, zero, dtype)

    @classmethod
    def from_affine(cls, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                    dtype: torch.dtype) -> "Int4Weight":
        """GPTQ / AWQ's form W = scale * (q - zero_point), scale and zero_point [G, N]."""
        return cls(q, scale.float(), int4_zero(scale, zero_point), dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] in self.dtype -> [M, N]."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size,
                                                          self.scales_and_zeros)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the kernel multiplies by (its scales as rounded to self.dtype)."""
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).reshape(self.out_features, -1)
        return int4_dequantize(q, self.scales_and_zeros).to(dtype)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


class Int8Weight:
    """A [N, K] weight as int8 with one scale per output channel: W = q * scale[:, None]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        if q.dtype != torch.int8:
            raise ValueError(f"the int8 CPU kernel takes int8 weights, not {q.dtype}")
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"the int8 CPU kernel runs {KERNEL_DTYPES} activations, not {dtype}")
        self.out_features, self.in_features = q.shape
        self.dtype = dtype
        self.q = q.contiguous()
        self.scale = scale.reshape(-1).to(dtype).contiguous()

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype) -> "Int8Weight":
        """Round to nearest, symmetric, per output channel: scale = max |w| / 127."""
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        return cls(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale.float()[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


def runs_kernel(x: torch.Tensor, kernel_dtype: torch.dtype) -> bool:
    """Whether a call with these activations goes through the integer kernel."""
    return (x.device.type == "cpu" and x.dtype == kernel_dtype
            and x.numel() // x.shape[-1] <= KERNEL_MAX_ROWS)
