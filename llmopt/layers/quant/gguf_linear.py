"""A linear layer whose weight is a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks or Q4_K / Q6_K
super-blocks, as stored.

At decode batch sizes the C++ kernels (`llmopt.kernels.cpu.gguf_blocks`, `.kquant_blocks`) read
the blocks directly: 8.5 bits a weight for Q8_0, 4.5 / 5 for Q4_0 / Q4_1, 4.5 / 6.56 for Q4_K /
Q6_K, against 16 for bf16, and a decode step's time is the time to read its weights. A large
batch of rows (a prompt) is compute-bound instead: with AVX512_VNNI the 32-weight types' panels
still win there (`KERNEL_MAX_ROWS`); elsewhere, and for the k-quants, which have no panels, the
layer multiplies prompts by a dense copy of the same weights, dequantized once. Without the C++
kernels every call takes the dense copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.kernels import cpu
from llmopt.kernels.cpu.gguf_blocks import ACTIVATIONS, MATMUL_DTYPES, GGUFBlockWeight
from llmopt.kernels.cpu.kquant_blocks import KQuantWeight

# Up to this many rows of x the block kernel beats the dense matmul in x's dtype. On AVX2 alone
# (gate_up 3072 x 576, benchmarks/results/cpu_kernels.md) fp32 dense takes over past 32 rows.
# With AVX512_VNNI the blocks run in panels of 16 rows (llmopt/kernels/cpu/gguf_panels.h) and win
# at every size, against dense fp32 and against a bf16 matmul without AMX, even at a prompt's
# hundreds of rows. So there prompts run on the blocks too, with int8 activations as llama.cpp's
# prompts do, and no dense copy is made. With AMX, torch's bf16 matmul runs on tile units: it
# draws level with the row-layout blocks at 16 rows and pulls far ahead beyond (panels not
# measured there), so there the dense copy takes over past 16 rows.
# (measured: benchmarks/README.md, "Measurements behind the code's choices")
_FLAGS = cpu.cpu_flags().split()
UNLIMITED = 1 << 30
KERNEL_MAX_ROWS = {torch.float32: UNLIMITED if "avx512_vnni" in _FLAGS else 32,
                   torch.bfloat16: 16 if "amx_bf16" in _FLAGS else UNLIMITED if "avx512_vnni" in _FLAGS else 512}
# The k-quants run their row kernels on every CPU (AVX2 instructions, no panels), so they take
# AVX2's limits everywhere: past them the dense copy.
ROW_KERNEL_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 16 if "amx_bf16" in _FLAGS else 512}

class GGUFLinear(nn.Module):
    """y = x @ W^T + b with W a `GGUFBlockWeight` or a `KQuantWeight`; `activations` picks the
    kernel's arithmetic ("int8": llama.cpp's, x rounded per 32 or 256 values; "float32": x as it is)."""

    def __init__(self, weight: GGUFBlockWeight | KQuantWeight, bias: torch.Tensor | None = None,
                 activations: str = "int8"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.weight_blocks, self.activations = weight, activations
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._dense: dict[torch.dtype, torch.Tensor] = {}

    def extra_repr(self) -> str:
        return (f"GGUFLinear(in={self.in_features}, out={self.out_features}, "
                f"{self.weight_blocks.type_name}, activations={self.activations})")

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The blocks dequantized, once per dtype (for prompts, and where no kernel runs)."""
        if dtype not in self._dense:
            self._dense[dtype] = self.weight_blocks.dequantize(dtype)
        return self._dense[dtype]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight_blocks.dequantize(dtype)

    def kernel_max_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows of x (in `dtype`) the block kernel runs; above, the dense copy."""
        limits = ROW_KERNEL_MAX_ROWS if isinstance(self.weight_blocks, KQuantWeight) else KERNEL_MAX_ROWS
        return limits[dtype]

    def runs_kernel(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in MATMUL_DTYPES
                and x.numel() // self.in_features <= self.kernel_max_rows(x.dtype) and cpu.available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_kernel(x):
            out = self.weight_blocks.matmul(x.reshape(-1, self.in_features).contiguous(), self.activations)
            out = out.view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.dense_weight(x.dtype).to(x.device))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def weight_bytes(self) -> int:
        """Bytes of the blocks (the dense copy, made only for prompts, not counted)."""
        return self.weight_blocks.nbytes()
