"""Int8 weights, one symmetric scale per output channel (round to nearest), weight-only.

`Int8Linear.from_linear` quantizes a float linear; on a CPU, bf16 / fp16 activations at decode
batch sizes go through torch's int8 kernel (`llmopt.layers.quant.cpu_int`), else the dense copy
`dequantize` gives, the reference; on CUDA it dequantizes on the fly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.layers.quant.cpu_int import Int8Weight
from llmopt.layers.quant.linear import QuantLinear, empty_param


class Int8Linear(QuantLinear):
    """int8 weight [N, K] and one fp32 scale per output channel: W ~ weight * weight_scale."""

    SHARDING = {"weight": (0, 1, 1), "weight_scale": (0, 1, 1), "bias": (0, 1, 1)}

    def __init__(self, in_features, out_features, bias=False, dtype=torch.float32):
        super().__init__(in_features, out_features)
        self.weight = empty_param((out_features, in_features), torch.int8)
        self.weight_scale = empty_param((out_features,), torch.float32)
        self.bias = empty_param((out_features,), dtype) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Round to nearest, symmetric: scale = max |w| / 127 per row, q = round(w / scale)."""
        w = linear.weight.float()
        m = cls(w.shape[1], w.shape[0], linear.bias is not None, linear.weight.dtype).to(w.device)
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        m.weight.data.copy_(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        m.weight_scale.data.copy_(scale)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias)
        return m

    def dequantize(self, dtype=torch.float32):
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def to_kernel_weight(self, dtype):
        return Int8Weight(self.weight.data, self.weight_scale, dtype)

    def forward(self, x):
        if x.is_cuda:  # dequantize on the fly: a dense copy would undo the memory saving
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        return super().forward(x)
