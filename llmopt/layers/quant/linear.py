"""The contract of a quantized linear, a drop-in for `nn.Linear` in the decoder.

The model calls `self.qkv_proj(x)` whatever module sits there; the loader puts these in
when a checkpoint's quantization_config (or `LLM(quantization=...)`) asks for them, and
leaves plain `nn.Linear` everywhere else. `QuantLinear` is what they share: loading by
shard, and the CPU's two paths. Bf16 / fp16 activations at decode batch sizes go through
torch's int4 / int8 CPU kernels (`llmopt.layers.quant.cpu_int`) where the weight has such a
form; everything else (fp32 activations, prefill, other widths) multiplies by a dense copy
dequantized once: the reference the kernels are tested against.

The linears, one file per format with its layout and dequantize reference: `GPTQLinear`
(gptq.py) and `AWQLinear` (awq.py), group-wise integers in the hub's packed layouts, both a
`GroupQuantLinear` (below); `Int8Linear` (int8.py); `NF4Linear` (nf4.py); `GGUFLinear`
(gguf_linear.py); and `Fp8Linear` (llmopt/fp8/linear.py). `make_quant_linear` (registry.py)
builds the one a checkpoint asks for.

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
from llmopt.kernels.quant_matmul import w4a16_matmul
from llmopt.layers.quant.cpu_int import KERNEL_DTYPES, Int4Weight, Int8Weight, int4_kernel_fits, runs_kernel
from llmopt.layers.quant.cuda_int4 import CudaInt4Weight, act_order_permutation, tinygemm_fits


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


class GroupQuantLinear(QuantLinear):
    """Group-wise integer weights (GPTQ's and AWQ's linears). On CUDA a 4-bit weight goes through
    tinygemm, repacked once into its tiles (llmopt/layers/quant/cuda_int4.py; kept beside the
    checkpoint's tensors, which the Triton kernel and `dequantize` read), or where tinygemm cannot
    run it (or `cuda_kernel = "triton"`, as the lesson and the benchmarks set it) through the
    readable Triton W4A16 kernel, which reads the packed words as stored; elsewhere QuantLinear's
    paths. Subclasses say what their integers mean through `affine()`."""

    layout = "gptq"
    cuda_kernel = "tinygemm"  # or "triton"

    def __init__(self, in_features, out_features, bits, group_size, bias, dtype):
        super().__init__(in_features, out_features)
        group = in_features if group_size == -1 else group_size
        if group < 1 or in_features % group:
            raise ValueError(f"group_size {group_size} must divide in_features ({in_features})")
        self.bits, self.group_size, self.groups = bits, group, in_features // group
        self.bias = empty_param((out_features,), dtype) if bias else None
        self.act_order = False
        self._tinygemm: tuple[torch.dtype, CudaInt4Weight | None] | None = None
        self.why_not_tinygemm: str | None = None  # why the last tinygemm() gave None

    def extra_repr(self) -> str:
        return (f"{type(self).__name__}(in={self.in_features}, out={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size})")

    @classmethod
    def from_quantized(cls, w, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):
        """The layer holding a `QuantizedWeight` (llmopt/layers/quant/formats.py), on w's device,
        written into this layout (`to_checkpoint`) and loaded as a checkpoint's tensors are."""
        n, k = w.shape
        layer = cls(k, n, w.bits, w.group_size, bias is not None, dtype).to(w.qweight.device)
        tensors = cls.to_checkpoint(w) | ({} if bias is None else {"bias": bias})
        for name, t in tensors.items():
            layer.load_checkpoint_tensor(name, t, None, name)
        layer.after_loading(f"a quantized [{n}, {k}] weight")
        return layer

    def load_checkpoint_tensor(self, name, tensor, rows, what) -> None:
        super().load_checkpoint_tensor(name, tensor, rows, what)
        self._tinygemm = None  # repacked from the new integers when next needed

    def affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K] integers, scale [G, N], zero point [G, N], g_idx [K] or None where groups are
        consecutive): W[n, k] = scale[g, n] * (q[n, k] - zero[g, n]), g = g_idx[k] or k // group_size."""
        raise NotImplementedError

    def to_kernel_weight(self, dtype):
        """The CPU's int4 kernel where it runs this weight (its groups consecutive)."""
        if self.bits != 4 or int4_kernel_fits(self.out_features, self.in_features, self.group_size) is not None:
            return None
        q, scale, zero, g_idx = self.affine()
        return None if g_idx is not None else Int4Weight.from_affine(q, scale, zero, dtype)

    def tinygemm(self, dtype: torch.dtype) -> CudaInt4Weight | None:
        """tinygemm's form of this weight for `dtype` activations, built once (None where it cannot run)."""
        if self._tinygemm is None or self._tinygemm[0] != dtype:
            weight = None
            self.why_not_tinygemm = tinygemm_fits(self.out_features, self.in_features, self.group_size, dtype,
                                                  self.weight_device())
            if self.why_not_tinygemm is None:
                q, scale, zero, g_idx = self.affine()
                try:
                    perm = None if g_idx is None else act_order_permutation(g_idx, self.group_size)
                    weight = CudaInt4Weight.from_affine(q, scale, zero, perm)
                except (RuntimeError, ValueError) as e:  # a torch build without the op: the Triton kernel
                    self.why_not_tinygemm = f"{type(e).__name__}: {e}"
            self._tinygemm = (dtype, weight)
        return self._tinygemm[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.bits == 4:
            rows = x.reshape(-1, self.in_features)
            fast = self.tinygemm(x.dtype) if self.cuda_kernel == "tinygemm" else None
            if fast is not None:
                out = fast.matmul(rows)
                out = out if self.bias is None else out + self.bias
            elif HAS_TRITON:
                g_idx = self.g_idx if self.layout == "gptq" and self.act_order else None
                out = w4a16_matmul(rows, self.qweight, self.qzeros, self.scales, g_idx, self.group_size,
                                   self.layout, self.bias)
            else:
                return super().forward(x)
            return out.view(*x.shape[:-1], self.out_features)
        return super().forward(x)
