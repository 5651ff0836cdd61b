"""`NF4Linear`: QLoRA's 4-bit NormalFloat weights, kept as 4-bit codes and multiplied by lookup.

The layer holds what a bitsandbytes checkpoint stores, two codes to a byte, plus one fp32
absmax per block (double quantization is undone once, on loading). NF4's 16 levels are not
evenly spaced, so no integer kernel can run them; each call instead expands the codes through
a 256-entry table (one byte -> its two levels), scales every block by its absmax and multiplies:
the dense weight exists only for the duration of one layer's matmul, never for the model.

A checkpoint stores one such weight per Hugging Face module (q_proj, k_proj, v_proj, ...), each
with its own quantization state; llmopt fuses q/k/v and gate/up, so every shard is decoded by
itself (`llmopt.layers.quant.nf4_format.from_bnb`) and placed at its output rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.layers.quant.linear import QuantLinear


class NF4Linear(QuantLinear):
    """weight: uint8 [N, K/2] (first code in the high nibble), absmax: fp32 [N * K / blocksize]
    (blocks run over the row-major weight, so with K not a multiple of the blocksize a block
    spans two rows, as bitsandbytes lays them out), quant_map: the 16 levels (NF4's, or FP4's
    when the checkpoint says so)."""

    OPTIONAL = ("absmax", "quant_map")  # built from each shard's quantization state in after_loading

    def __init__(self, in_features, out_features, blocksize=64, bias=False, dtype=torch.float32):
        super().__init__(in_features, out_features)
        if in_features % 2 or blocksize < 1 or (in_features * out_features) % blocksize:
            raise ValueError(f"NF4Linear needs in_features ({in_features}) even and whole blocks of "
                             f"{blocksize} in its {out_features} x {in_features} weight")
        self.blocksize = blocksize
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8), requires_grad=False)
        self.absmax = nn.Parameter(torch.empty(out_features * in_features // blocksize), requires_grad=False)
        self.quant_map = nn.Parameter(torch.empty(16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._pending: dict[tuple[int, int], dict[str, tuple[torch.Tensor, str]]] = {}
        self._table: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"NF4Linear(in={self.in_features}, out={self.out_features}, blocksize={self.blocksize})"

    @classmethod
    def from_codes(cls, codes: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor,
                   bias: torch.Tensor | None = None) -> "NF4Linear":
        n, k = codes.shape
        m = cls(k, n, n * k // absmax.numel(), bias is not None, torch.float32 if bias is None else bias.dtype)
        m.weight.data = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)
        m.absmax.data, m.quant_map.data = absmax.float().reshape(-1).clone(), quant_map.float().clone()
        if bias is not None:
            m.bias.data = bias.clone()
        return m

    # -- loading: collect each shard's tensors, decode them once all are in ------------------------------
    def load_checkpoint_tensor(self, name, tensor, rows, what):
        if name == "bias":
            return super().load_checkpoint_tensor(name, tensor, rows, what)
        self._pending.setdefault(rows or (0, self.out_features), {})[name] = (tensor, what)

    def after_loading(self, source: str) -> None:
        from llmopt.layers.quant.nf4_format import from_bnb

        covered = 0
        for (a, b), parts in sorted(self._pending.items()):
            what = next(iter(parts.values()))[1]
            codes, absmax, quant_map, blocksize, shape = from_bnb({k: t for k, (t, _) in parts.items()}, what)
            if shape != [b - a, self.in_features] or blocksize != self.blocksize:
                raise ValueError(f"{what}: a {shape} weight in blocks of {blocksize}; this layer expects "
                                 f"[{b - a}, {self.in_features}] in blocks of {self.blocksize}")
            if covered and not torch.equal(self.quant_map.data, quant_map.to(self.quant_map.device)):
                raise ValueError(f"{what}: its quant_map differs from the other shards of this fused layer")
            self.quant_map.data.copy_(quant_map)
            if (a * self.in_features) % blocksize:
                raise ValueError(f"{what}: this shard's blocks do not start on a block boundary of the fused layer")
            self.weight.data[a:b] = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(self.weight.device)
            k = self.in_features
            self.absmax.data[a * k // blocksize:b * k // blocksize] = absmax.to(self.absmax.device)
            covered += b - a
        if covered != self.out_features:
            raise ValueError(f"{source}: bitsandbytes weights cover {covered} of {self.out_features} output "
                             f"rows of {self.extra_repr()}")
        self._pending, self._table = {}, None

    # -- running -------------------------------------------------------------------------------------------
    def byte_table(self) -> torch.Tensor:
        """[256, 2] fp32: the two levels every byte holds (high nibble first)."""
        if self._table is None:
            b = torch.arange(256, device=self.quant_map.device)
            self._table = torch.stack([self.quant_map[b >> 4], self.quant_map[b & 15]], -1).float()
        return self._table

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        levels = self.byte_table().index_select(0, self.weight.reshape(-1).int())    # [N * K / 2, 2]
        w = levels.view(-1, self.blocksize) * self.absmax[:, None]
        return w.view(n, k).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the codes stay the layer's only copy: expanded per call, freed after the matmul
        return F.linear(x, self.dequantize(x.dtype), self.bias)
