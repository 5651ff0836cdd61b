"""Linear layers for quantized weights, each a drop-in for `nn.Linear` in the decoder.

The model calls `self.qkv_proj(x)` whatever module sits there; the loader puts these in
when a checkpoint's quantization_config (or `LLM(quantization=...)`) asks for them, and
leaves plain `nn.Linear` everywhere else.

- `GPTQLinear` / `AWQLinear`: group-wise integer weights in the hub's packed layouts
  (`llmopt.kernels.quant_matmul`). On CUDA, 4-bit weights go through the Triton W4A16
  kernel, which reads the packed words directly. On a CPU, bf16 / fp16 activations at
  decode batch sizes go through torch's int4 CPU kernel (`llmopt.layers.quant.cpu_int`): 4-bit,
  no act-order, group size 32-256. Everything else (fp32 activations, prefill, other
  widths) multiplies by a dense copy unpacked once: the reference the kernels are tested
  against.
- `Int8Linear`: int8 weights, one symmetric scale per output channel (RTN), weight-only;
  torch's int8 CPU kernel on the same terms.
- `NF4Linear` (nf4_linear.py), `GGUFLinear` (gguf_linear.py) and `Fp8Linear` (llmopt/fp8/linear.py)
  follow the same contract; `make_quant_linear` (registry.py) builds the one a checkpoint asks for.

A checkpoint may store one linear as several shards that llmopt fuses (q/k/v into
qkv_proj, gate/up into gate_up_proj). Each module therefore says, per tensor, along which
dimension its output channels run and how many stored elements one channel takes
(`SHARDING`), so the loader can put a shard's packed tensor in the right place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.kernels import HAS_TRITON
from llmopt.kernels.quant_matmul import awq_dequantize, awq_unpack, gptq_dequantize, unpack, w4a16_matmul
from llmopt.layers.quant.cpu_int import KERNEL_DTYPES, Int4Weight, Int8Weight, int4_kernel_fits, runs_kernel


def empty_param(shape, dtype) -> nn.Parameter:
    """A frozen parameter of this shape and dtype, for the loader to fill."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantLinear(nn.Module):
    """What every quantized linear shares: checkpoint loading by shard, byte counts, and the
    dense copy the CPU path multiplies with."""

    # tensor name -> (output dim, stored elements per output channel as num / den); None: shared
    SHARDING: dict[str, tuple[int, int, int] | None] = {"bias": (0, 1, 1)}
    OPTIONAL: tuple[str, ...] = ()  # tensors a checkpoint may leave out

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._loaded: dict[str, list] = {}
        self._dense: tuple[torch.dtype, torch.Tensor] | None = None
        self._kernel: tuple[torch.dtype, Int4Weight | Int8Weight | None] | None = None

    # -- loading ---------------------------------------------------------------------------------------
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None,
                               what: str) -> None:
        """Copy one checkpoint tensor (or one shard of a fused layer: output `rows`) into place."""
        param = getattr(self, name)
        layout = self.SHARDING[name]
        if layout is None or rows is None:
            dest = param.data
        else:
            dim, num, den = layout
            a, b = rows
            if (a * num) % den or (b * num) % den:
                raise ValueError(f"{what}: output rows {a}..{b} do not fall on packed-word boundaries")
            dest = param.data.narrow(dim, a * num // den, (b - a) * num // den)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} "
                             f"for {self.extra_repr()}")
        if not dest.dtype.is_floating_point and tensor.dtype != dest.dtype:
            raise ValueError(f"{what} has dtype {tensor.dtype}, expected {dest.dtype}")
        seen = self._loaded.setdefault(name, [])
        if layout is None and seen and not torch.equal(dest, tensor.to(dest.device, dest.dtype)):
            raise ValueError(f"{what} differs from the other shards of this fused layer; llmopt runs "
                             "them as one matmul and needs them to share it")
        dest.copy_(tensor.to(dest.dtype))
        seen.append(rows)
        self._dense = self._kernel = None

    def after_loading(self, source: str) -> None:
        """Checks (and defaults) once every tensor is in."""

    # -- running ---------------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] this layer multiplies by, in `dtype`."""
        raise NotImplementedError

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized once and kept (the weights do not change after loading). Where a CPU
        kernel runs this layer in `dtype`, the copy holds the kernel's own weights (its scales
        rounded to `dtype`), so that a sequence's logits do not depend on its batch's size."""
        if self._dense is None or self._dense[0] != dtype:
            kernel = self.kernel_weight(dtype) if self.weight_device().type == "cpu" else None
            self._dense = (dtype, kernel.dequantize(dtype) if kernel is not None else self.dequantize(dtype))
        return self._dense[1]

    def weight_device(self) -> torch.device:
        return next(p.device for n, p in self.named_parameters() if n != "bias")

    def to_kernel_weight(self, dtype: torch.dtype) -> Int4Weight | Int8Weight | None:
        """This layer's weight in a form torch's CPU int kernels run (None: no such form)."""
        return None

    def kernel_weight(self, dtype: torch.dtype) -> Int4Weight | Int8Weight | None:
        """`to_kernel_weight`, built once per activation dtype."""
        if dtype not in KERNEL_DTYPES:
            return None
        if self._kernel is None or self._kernel[0] != dtype:
            self._kernel = (dtype, self.to_kernel_weight(dtype))
        return self._kernel[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_kernel(x, x.dtype):
            kernel = self.kernel_weight(x.dtype)
            if kernel is not None:
                out = kernel.matmul(x.reshape(-1, self.in_features).contiguous())
                out = out.view(*x.shape[:-1], self.out_features)
                return out if self.bias is None else out + self.bias
        return F.linear(x, self.dense_weight(x.dtype), self.bias)

    def weight_bytes(self) -> int:
        """Bytes of the stored (quantized) weight tensors, bias excluded."""
        return sum(p.numel() * p.element_size() for n, p in self.named_parameters() if n != "bias")


class _GroupQuantLinear(QuantLinear):
    layout = "gptq"

    def __init__(self, in_features, out_features, bits, group_size, bias, dtype):
        super().__init__(in_features, out_features)
        group = in_features if group_size == -1 else group_size
        if group < 1 or in_features % group:
            raise ValueError(f"group_size {group_size} must divide in_features ({in_features})")
        self.bits, self.group_size, self.groups = bits, group, in_features // group
        self.bias = empty_param((out_features,), dtype) if bias else None
        self.act_order = False

    def extra_repr(self) -> str:
        return (f"{type(self).__name__}(in={self.in_features}, out={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and HAS_TRITON and self.bits == 4:
            g_idx = self.g_idx if self.layout == "gptq" and self.act_order else None
            out = w4a16_matmul(x.reshape(-1, self.in_features), self.qweight, self.qzeros, self.scales,
                               g_idx, self.group_size, self.layout, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return super().forward(x)


class GPTQLinear(_GroupQuantLinear):
    """AutoGPTQ's v1 layout: qweight [K*bits/32, N], qzeros [K/G, N*bits/32] (zero - 1),
    scales [K/G, N], g_idx [K]."""

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

    def to_kernel_weight(self, dtype):
        if self.act_order:
            return None  # input columns out of group order: the kernel's groups are consecutive
        q = unpack(self.qweight, self.bits, dim=0).t()                 # [N, K]
        zeros = unpack(self.qzeros, self.bits, dim=1) + 1              # [G, N]; v1 stores zero - 1
        if self.bits == 4 and int4_kernel_fits(self.out_features, self.in_features, self.group_size) is None:
            return Int4Weight.from_affine(q, self.scales, zeros, dtype)
        if self.bits == 8 and self.groups == 1 and bool((zeros == 128).all()):  # symmetric, per channel
            return Int8Weight((q - 128).to(torch.int8), self.scales.float()[0], dtype)
        return None

    def dequantize(self, dtype=torch.float32):
        return gptq_dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, dtype).t().contiguous()


class AWQLinear(_GroupQuantLinear):
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [K/G, N/8] packed along the output
    dimension in nibble order [0, 2, 4, 6, 1, 3, 5, 7], scales [K/G, N]."""

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

    def to_kernel_weight(self, dtype):
        if int4_kernel_fits(self.out_features, self.in_features, self.group_size) is not None:
            return None
        return Int4Weight.from_affine(awq_unpack(self.qweight).t(), self.scales, awq_unpack(self.qzeros), dtype)

    def dequantize(self, dtype=torch.float32):
        return awq_dequantize(self.qweight, self.qzeros, self.scales, self.group_size, dtype).t().contiguous()


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
