"""GPTQ's checkpoint layout (AutoGPTQ v1) and the linear that runs it.

On disk: qweight int32 [K * bits / 32, N], packed along the input dimension; qzeros
[groups, N * bits / 32], packed along the output dimension and holding zero - 1; scales fp16
[groups, N]; g_idx [K], each input column's group (act-order checkpoints permute them).
`to_gptq` writes a `QuantizedWeight` so; `GPTQLinear` loads it, and its `dequantize` (through
`llmopt.kernels.quant_matmul.gptq_dequantize`) is the reference its kernels are held to.
"""

from __future__ import annotations

import torch

from llmopt.kernels.quant_matmul import gptq_dequantize, unpack
from llmopt.layers.quant.cpu_int import Int8Weight
from llmopt.layers.quant.formats import GPTQ_BITS, QuantizedWeight, pack
from llmopt.layers.quant.linear import GroupQuantLinear, empty_param


def to_gptq(w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The tensors AutoGPTQ writes for one linear (checkpoint_format "gptq", v1)."""
    if w.bits not in GPTQ_BITS:
        raise ValueError(f"the GPTQ layout stores {GPTQ_BITS} bits, not {w.bits}")
    maxq = (1 << w.bits) - 1
    if (w.zeros < 1).any():
        # v1 stores zero - 1, so a zero point of 0 cannot be written; the quantizers keep
        # zeros >= 1 when they write this layout (min_zero=1)
        raise ValueError("a zero point of 0 cannot be stored in the GPTQ v1 layout (it stores zero - 1)")
    return {"qweight": pack(w.qweight.t(), w.bits, dim=0),            # [K * bits / 32, N]
            "qzeros": pack((w.zeros - 1) & maxq, w.bits, dim=1),       # [groups, N * bits / 32]
            "scales": w.scales.to(torch.float16).contiguous(),         # [groups, N]
            "g_idx": w.g_idx.to(torch.int32).contiguous()}             # [K]


class GPTQLinear(GroupQuantLinear):
    """AutoGPTQ's v1 layout: qweight [K*bits/32, N], qzeros [K/G, N*bits/32] (zero - 1),
    scales [K/G, N], g_idx [K]."""

    to_checkpoint = staticmethod(to_gptq)

    OPTIONAL = ("g_idx",)  # older checkpoints without act-order leave it out: k // G

    def __init__(self, in_features, out_features, bits=4, group_size=128, bias=False, dtype=torch.float32):
        super().__init__(in_features, out_features, bits, group_size, bias, dtype)
        for n, name in ((in_features, "in_features"), (out_features, "out_features")):
            if (n * bits) % 32:
                raise ValueError(f"{name} ({n}) x {bits} bits must fill whole int32 words")
        K, N = in_features, out_features
        self.qweight = empty_param((K * bits // 32, N), torch.int32)
        self.qzeros = empty_param((self.groups, N * bits // 32), torch.int32)
        self.scales = empty_param((self.groups, N), torch.float16)
        self.g_idx = empty_param((K,), torch.int32)
        self.SHARDING = {"qweight": (1, 1, 1), "qzeros": (1, bits, 32), "scales": (1, 1, 1),
                         "g_idx": None, "bias": (0, 1, 1)}

    def after_loading(self, source: str) -> None:
        order = torch.arange(self.in_features, device=self.g_idx.device, dtype=torch.int32) // self.group_size
        if "g_idx" not in self._loaded:
            self.g_idx.data.copy_(order)
        if self.g_idx.numel() and (self.g_idx.min() < 0 or self.g_idx.max() >= self.groups):
            raise ValueError(f"{source}: g_idx names groups outside [0, {self.groups}) in {self.extra_repr()}")
        self.act_order = not torch.equal(self.g_idx, order)

    def affine(self):
        q = unpack(self.qweight, self.bits, dim=0).t()                 # [N, K]
        zeros = unpack(self.qzeros, self.bits, dim=1) + 1              # [G, N]; v1 stores zero - 1
        return q, self.scales, zeros, self.g_idx if self.act_order else None

    def to_kernel_weight(self, dtype):
        if self.bits == 8 and self.groups == 1 and not self.act_order:
            q, scale, zeros, _ = self.affine()
            if bool((zeros == 128).all()):  # symmetric, per channel
                return Int8Weight((q - 128).to(torch.int8), scale.float()[0], dtype)
        return super().to_kernel_weight(dtype)  # 4 bits, groups in order: the int4 kernel

    def dequantize(self, dtype=torch.float32):
        return gptq_dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, dtype).t().contiguous()
