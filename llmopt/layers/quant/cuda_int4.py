"""W4A16 on a GPU through torch's int4 kernel (tinygemm: what gpt-fast and torchao run).

At batch 1 a decode step reads every weight once, so a 4-bit weight should cost a quarter of a
bf16 one. A kernel only gets there if it streams the packed words at the memory's speed; the
readable Triton kernel (llmopt/kernels/quant_matmul.py) unpacks nibbles in the layout the
checkpoint stores, which is not the layout a GPU reads fastest. tinygemm repacks the weight once,
at load, into tiles its tensor-core loop consumes directly:

    torch.ops.aten._convert_weight_to_int4pack(bytes [N, K/2] uint8, inner_k_tiles)
    torch.ops.aten._weight_int4pack_mm(x [M, K] bf16, packed, group_size, scales_and_zeros [K/G, N, 2])

and multiplies by W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // group_size: the
same affine form as its CPU twin (llmopt/layers/quant/cpu_int.py), which every 4-bit format maps
onto (GPTQ / AWQ's scale * (q - z): zero = scale * (8 - z)). Each byte holds two consecutive
columns, the even one in its high nibble.

Act-order GPTQ checkpoints name a group per input column (g_idx) out of order; sorting the columns
by group makes the groups consecutive, and the layer then gathers x's columns in the same order
before the product (one small kernel): x W^T = x[:, perm] W[:, perm]^T.

tinygemm runs bfloat16 activations on compute capability 8.0 and later, output widths that are a
multiple of 8, inputs a multiple of 32, groups of 32 to 256; `tinygemm_fits` says why not
elsewhere, and the layer takes the Triton kernel instead.
"""

from __future__ import annotations

import torch

from llmopt.layers.quant.cpu_int import int4_dequantize, int4_scales_and_zeros, int4_zero

GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = (8, 4, 2)  # the most 16-column tiles a pass of the kernel's loop takes that K allows


def tinygemm_fits(out_features: int, in_features: int, group_size: int, dtype: torch.dtype, device) -> str | None:
    """Why tinygemm cannot run this layer here (None when it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "tinygemm is a CUDA kernel"
    if dtype != torch.bfloat16:
        return f"tinygemm multiplies bfloat16 activations, not {dtype}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "tinygemm needs compute capability 8.0 (Ampere) or later"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} (tinygemm takes {GROUP_SIZES})"
    if out_features % 8 or in_features % 32:
        return f"a [{out_features}, {in_features}] weight (tinygemm needs out % 8 == 0 and in % 32 == 0)"
    return None


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input-column order that makes act-order groups consecutive (None: they already are),
    or ValueError when the groups are not all `group_size` columns."""
    order = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if torch.equal(g_idx.long(), order):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], order):
        raise ValueError(f"g_idx does not hold {group_size} columns in every group")
    return perm


def tinygemm_operands(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] integers in [0, 16), scale and zero [K/G, N] (W = (q - 8) * scale + zero) -> the
    bytes [N, K/2] (column 2j in the high nibble) and scales_and_zeros [K/G, N, 2] in bfloat16."""
    q = q.to(torch.int32)
    nibbles = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    return nibbles, int4_scales_and_zeros(scale, zero, torch.bfloat16)


def tinygemm_dequantize(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in float32 that tinygemm multiplies by, from `tinygemm_operands`' output."""
    return int4_dequantize(torch.stack([nibbles >> 4, nibbles & 15], -1).flatten(-2), scales_and_zeros)


class CudaInt4Weight:
    """A [N, K] weight as tinygemm wants it; `matmul(x)` = x W^T for x [M, K] in bfloat16."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, perm: torch.Tensor | None = None):
        n, k = q.shape
        self.out_features, self.in_features, self.group_size = n, k, k // scale.shape[0]
        why = tinygemm_fits(n, k, self.group_size, torch.bfloat16, q.device)
        if why is not None:
            raise ValueError(f"tinygemm cannot run a [{n}, {k}] weight: {why}")
        self.perm = perm
        if perm is not None:  # columns in group order (act-order checkpoints)
            q = q[:, perm]
        nibbles, self.scales_and_zeros = tinygemm_operands(q, scale, zero)
        inner = next(t for t in INNER_K_TILES if k % (16 * t) == 0)
        self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, inner)

    @classmethod
    def from_affine(cls, q, scale, zero_point, perm=None) -> "CudaInt4Weight":
        """GPTQ / AWQ's form W = scale * (q - zero_point), scale and zero_point [G, N]."""
        return cls(q, scale.float(), int4_zero(scale, zero_point), perm)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()
