"""AWQ's checkpoint layout (AutoAWQ, version "gemm") and the linear that runs it.

On disk: qweight int32 [K, N / 8] and qzeros [groups, N / 8], both packed along the output
dimension in nibble order [0, 2, 4, 6, 1, 3, 5, 7]; scales fp16 [groups, N]; 4-bit only, groups
of consecutive input columns (no g_idx). `to_awq` writes a `QuantizedWeight` so; `AWQLinear`
loads it, and its `dequantize` (through `llmopt.kernels.quant_matmul.awq_dequantize`) is the
reference its kernels are held to.
"""

from __future__ import annotations

import torch

from llmopt.kernels.quant_matmul import AWQ_PACK_ORDER, awq_dequantize, awq_unpack
from llmopt.layers.quant.formats import AWQ_BITS, QuantizedWeight, pack
from llmopt.layers.quant.linear import GroupQuantLinear, empty_param


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, N] 4-bit integers -> AWQ words [rows, N/8]: nibble i holds column AWQ_PACK_ORDER[i]."""
    rows, n = values.shape
    order = torch.tensor(AWQ_PACK_ORDER, device=values.device)
    return pack(values.view(rows, n // 8, 8)[:, :, order].reshape(rows, n), 4, dim=1)


def to_awq(w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The tensors AutoAWQ writes for one linear (version "gemm")."""
    if w.bits not in AWQ_BITS:
        raise ValueError(f"the AWQ GEMM layout stores 4-bit weights only, not {w.bits}-bit; "
                         "write other widths in the GPTQ layout (format='gptq')")
    if w.has_act_order:
        raise ValueError("the AWQ layout has no g_idx: groups must be consecutive input columns")
    return {"qweight": pack_awq(w.qweight.t().contiguous()),        # [K, N/8]
            "qzeros": pack_awq(w.zeros.contiguous()),                # [groups, N/8]
            "scales": w.scales.to(torch.float16).contiguous()}       # [groups, N]


class AWQLinear(GroupQuantLinear):
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [K/G, N/8] packed along the output
    dimension in nibble order [0, 2, 4, 6, 1, 3, 5, 7], scales [K/G, N]."""

    to_checkpoint = staticmethod(to_awq)

    layout = "awq"
    SHARDING = {"qweight": (1, 1, 8), "qzeros": (1, 1, 8), "scales": (1, 1, 1), "bias": (0, 1, 1)}

    def __init__(self, in_features, out_features, bits=4, group_size=128, bias=False, dtype=torch.float32):
        if bits != 4:
            raise ValueError(f"the AWQ GEMM layout is 4-bit only, got bits={bits}")
        super().__init__(in_features, out_features, bits, group_size, bias, dtype)
        if out_features % 8:
            raise ValueError(f"out_features ({out_features}) must be a multiple of 8 for the AWQ layout")
        K, N = in_features, out_features
        self.qweight = empty_param((K, N // 8), torch.int32)
        self.qzeros = empty_param((self.groups, N // 8), torch.int32)
        self.scales = empty_param((self.groups, N), torch.float16)

    def affine(self):
        return awq_unpack(self.qweight).t(), self.scales, awq_unpack(self.qzeros), None

    def dequantize(self, dtype=torch.float32):
        return awq_dequantize(self.qweight, self.qzeros, self.scales, self.group_size, dtype).t().contiguous()
