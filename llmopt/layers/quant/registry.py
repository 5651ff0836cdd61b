"""Which quantized linear a checkpoint's quantization asks for, built empty for the loader to fill."""

from __future__ import annotations

import torch

from llmopt.fp8.linear import Fp8Linear
from llmopt.layers.quant.awq import AWQLinear
from llmopt.layers.quant.gptq import GPTQLinear
from llmopt.layers.quant.linear import QuantLinear


def make_quant_linear(scheme, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> QuantLinear:
    """The module a `QuantScheme` (llmopt/layers/quant/formats.py) asks for, empty, ready to load into."""
    if scheme.method == "gptq":
        return GPTQLinear(in_features, out_features, scheme.bits, scheme.group_size, bias, dtype)
    if scheme.method == "awq":
        return AWQLinear(in_features, out_features, scheme.bits, scheme.group_size, bias, dtype)
    if scheme.method == "fp8":
        return Fp8Linear(in_features, out_features, bias, dtype, scheme.activation_scheme == "static")
    raise ValueError(f"no serialized quantized linear for method {scheme.method!r}")
