"""`Fp8Linear`: float8 e4m3 weights with one fp32 scale per output channel, a drop-in for
`nn.Linear` like the other quantized linears (llmopt/layers/quant/linear.py says the contract).

CUDA GPUs with FP8 tensor cores (compute capability >= 8.9) multiply in fp8 (`torch._scaled_mm`),
so the activations are rounded to fp8 too, per token on the fly or with a static `input_scale`
from the checkpoint (W8A8). Elsewhere nothing multiplies fp8: the weights are widened to the
activations' dtype and multiplied there (W8A16, as vLLM's FP8 Marlin kernel runs on older GPUs).
`quantize_activations = True` emulates W8A8 there in fp32 (products of fp8 values are exact in
fp32): what lesson 07 and the precision table measure beside weight-only.

At decode batch sizes (at most FP8_WEIGHT_ONLY_ROWS rows) a GPU runs weight-only even where FP8
units multiply: a product of a few rows costs its weights' bytes, and the W8A16 Triton kernel
(llmopt/kernels/fp8_matmul.py) reads the fp8 bytes and widens them in registers, where W8A8 first
rounds the activations (two more kernels) and runs a GEMM tiled for large products. So on such a
GPU a sequence's numbers depend on how many rows its step holds (W8A16 at a few, W8A8 above), as
they do in vLLM's FP8 paths; `quantize_activations = True` or False fixes one path for every size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.fp8.format import native_fp8_supported, per_channel_scale, per_token_scale, quantize_fp8
from llmopt.kernels import HAS_TRITON
from llmopt.kernels.fp8_matmul import fp8_weight_matmul
from llmopt.layers.quant.linear import QuantLinear, empty_param


FP8_WEIGHT_ONLY_ROWS = 16


class Fp8Linear(QuantLinear):
    """float8_e4m3fn weight [N, K], fp32 weight_scale [N, 1], optional static input_scale."""

    SHARDING = {"weight": (0, 1, 1), "weight_scale": (0, 1, 1), "input_scale": None, "bias": (0, 1, 1)}

    def __init__(self, in_features, out_features, bias=False, dtype=torch.float32, static_input_scale=False):
        super().__init__(in_features, out_features)
        self.weight = empty_param((out_features, in_features), torch.float8_e4m3fn)
        self.weight_scale = empty_param((out_features, 1), torch.float32)
        self.input_scale = empty_param((), torch.float32) if static_input_scale else None
        self.bias = empty_param((out_features,), dtype) if bias else None
        self._w32: torch.Tensor | None = None
        # Round activations to fp8 first? None: only where FP8 units multiply (W8A8). On SmolLM2 it
        # costs as much again as the weights' rounding (+0.90% weight-only, +1.78% W8A8).
        self.quantize_activations: bool | None = None

    def extra_repr(self) -> str:
        return f"Fp8Linear(in={self.in_features}, out={self.out_features})"

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Per-output-channel scales: scale = max |w| / 448 per row, weight = fp8(w / scale)."""
        w = linear.weight.float()
        m = cls(w.shape[1], w.shape[0], linear.bias is not None, linear.weight.dtype).to(w.device)
        scale = per_channel_scale(w)
        m.weight.data.copy_(quantize_fp8(w, scale))
        m.weight_scale.data.copy_(scale)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias)
        return m

    def load_checkpoint_tensor(self, name, tensor, rows, what):
        if name == "weight" and tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{what} has dtype {tensor.dtype}; FP8 checkpoints store float8_e4m3fn weights")
        if name == "weight_scale" and tensor.numel() == 1:
            # a per-tensor scale: every row of this shard shares it
            a, b = rows if rows is not None else (0, self.out_features)
            tensor = tensor.float().reshape(1, 1).expand(b - a, 1)
        elif name == "weight_scale":
            tensor = tensor.reshape(-1, 1)
        elif name == "input_scale":
            if tensor.numel() != 1:
                raise ValueError(f"{what}: a static input_scale is one number, got shape {tuple(tensor.shape)}")
            # fused shards run on one input: the largest scale covers all of them (as vLLM does)
            tensor = tensor.float().reshape(())
            if self._loaded.get("input_scale"):
                self.input_scale.data.copy_(torch.maximum(self.input_scale.data, tensor))
                return
        super().load_checkpoint_tensor(name, tensor, rows, what)
        self._w32 = None

    def dequantize(self, dtype=torch.float32):
        return (self.weight.float() * self.weight_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        native = native_fp8_supported(x.device) and self.in_features % 16 == 0 and self.out_features % 16 == 0
        w8a8 = native and x2.shape[0] > FP8_WEIGHT_ONLY_ROWS  # (the module's note)
        if not (w8a8 if self.quantize_activations is None else self.quantize_activations):
            out = self._weight_only(x2)
        else:
            # activation scales: per token, computed now ("dynamic"), or one stored number ("static")
            x_scale = per_token_scale(x2) if self.input_scale is None else self.input_scale.reshape(1, 1)
            xq = quantize_fp8(x2, x_scale)
            out = self._native(xq, x_scale, x.dtype) if native else self._emulated(xq, x_scale)
        out = out if self.bias is None else out + self.bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _weight_only(self, x2: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """W8A16. On a GPU the weights are widened to x's dtype as they are used (16 bits; a kept fp32
        copy would take 4x the fp8 bytes); on a CPU, or `exact`, in fp32: x . (q s) = (x . q) s."""
        if x2.is_cuda and not exact:
            if HAS_TRITON and x2.shape[0] <= FP8_WEIGHT_ONLY_ROWS:  # the fp8 bytes, widened in registers
                return fp8_weight_matmul(x2, self.weight, self.weight_scale, out_dtype=torch.float32)
            return F.linear(x2, self.dequantize(x2.dtype)).float()
        self._w32 = self.weight.float() if self._w32 is None else self._w32
        return (x2.float() @ self._w32.t()) * self.weight_scale.t()

    def _emulated(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """fp8 x fp8 products, exact and summed in fp32, then both scales: what the tensor cores compute."""
        return self._weight_only(xq, exact=True) * x_scale

    def _native(self, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        w = self.weight.t()  # [K, N] column-major, as _scaled_mm wants its second operand
        if dtype == torch.bfloat16 and torch.cuda.get_device_capability(xq.device) >= (9, 0):
            # Hopper: row-wise scales applied in the matmul's epilogue (bf16 output only)
            a = x_scale.expand(xq.shape[0], 1).contiguous()
            return torch._scaled_mm(xq, w, scale_a=a, scale_b=self.weight_scale.t().contiguous(),
                                    out_dtype=torch.bfloat16).float()
        # elsewhere: unit scales, fp32 output, then both scales, as the emulation applies them
        one = torch.ones((), device=xq.device)
        acc = torch._scaled_mm(xq, w, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return acc * (x_scale * self.weight_scale.t())


def round_fp8_activations(model: nn.Module, on: bool | None = True) -> None:
    """Every Fp8Linear's `quantize_activations` (True: W8A8 anywhere; None: where FP8 units multiply)."""
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.quantize_activations = on
