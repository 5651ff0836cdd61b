"""GGUF Q8_0 / Q4_0 / Q4_1 weights kept in their blocks of 32, multiplied as llama.cpp does.

A GGUF tensor is rows of blocks; each block holds 32 weights and an fp16 scale d:

    Q8_0  d, 32 x int8                      w = d * q
    Q4_0  d, 16 bytes of 4-bit q            w = d * (q - 8)
    Q4_1  d, m, 16 bytes of 4-bit q         w = d * q + m

(in the 4-bit types a block's byte j holds weight j in its low nibble, weight j + 16 in its
high one). `GGUFBlockWeight` keeps exactly these numbers, only split into arrays (quants,
d, m), and `matmul` runs the C++ kernel (llmopt/kernels/cpu/gguf_matmul.cpp; with AVX512_VNNI
on the same blocks regrouped by `panels` into 16 rows, gguf_panels.cpp). With
`activations="int8"` (the default, llama.cpp's arithmetic) each row of x is first rounded per
32 values to int8 with an fp16 scale, and block dot products are exact integer sums;
`emulate_int8` computes the same thing in plain torch. `activations="float32"` multiplies
the exact weights by unrounded x. `dequantize` is the plain-torch meaning of the blocks.

The k-quants (Q4_K, Q6_K: super-blocks of 256 weights, two levels of scales) are
llmopt.kernels.cpu.kquant_blocks's `KQuantWeight`, with the same interface.
"""

from __future__ import annotations

import numpy as np
import torch

from llmopt.kernels import cpu

BLOCK = 32
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}   # llama.cpp's ggml_type numbers
ACTIVATIONS = ("int8", "float32")
MATMUL_DTYPES = (torch.float32, torch.bfloat16)


class GGUFBlockWeight:
    """A [N, K] weight as GGUF blocks: qs uint8 [N, K / 32, 32 or 16], d (and m) fp16 [N, K / 32]."""

    def __init__(self, type_name: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None):
        if type_name not in GGML_TYPES:
            raise ValueError(f"GGUF block type must be one of {tuple(GGML_TYPES)}, got {type_name!r}")
        per_block = 32 if type_name == "Q8_0" else 16
        if qs.dtype != torch.uint8 or qs.dim() != 3 or qs.shape[2] != per_block:
            raise ValueError(f"{type_name} quants must be uint8 [N, K / 32, {per_block}], got "
                             f"{qs.dtype} {tuple(qs.shape)}")
        if d.dtype != torch.float16 or tuple(d.shape) != tuple(qs.shape[:2]):
            raise ValueError(f"d must be float16 {tuple(qs.shape[:2])}, got {d.dtype} {tuple(d.shape)}")
        if (type_name == "Q4_1") != (m is not None):
            raise ValueError("Q4_1 blocks carry a min m (float16, like d); Q4_0 and Q8_0 do not")
        self.type_name, self.ggml_type = type_name, GGML_TYPES[type_name]
        self.qs, self.d = qs.contiguous(), d.contiguous()
        self.m = None if m is None else m.to(torch.float16).contiguous()
        self.out_features, self.in_features = qs.shape[0], qs.shape[1] * BLOCK
        self._no_min = torch.empty(0, dtype=torch.float16)

    @classmethod
    def from_gguf_bytes(cls, data: np.ndarray, type_name: str, row_len: int) -> "GGUFBlockWeight":
        """A tensor's bytes as the file stores them, [rows, bytes per row] -> its blocks."""
        blocks = file_blocks(data, type_name, row_len, GGML_TYPES, BLOCK)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].copy())
        m = None
        if type_name == "Q4_1":
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].copy())
        start = 4 if type_name == "Q4_1" else 2
        return cls(type_name, torch.from_numpy(blocks[..., start:].copy()), d, m)

    @classmethod
    def cat(cls, parts: list["GGUFBlockWeight"]) -> "GGUFBlockWeight":
        """Weights of one type stacked by rows (q, k, v into qkv_proj; gate, up into gate_up_proj)."""
        kinds = {p.type_name for p in parts}
        if len(kinds) != 1 or len({p.in_features for p in parts}) != 1:
            raise ValueError(f"only weights of one type and width stack into one kernel, got {sorted(kinds)}")
        m = torch.cat([p.m for p in parts]) if parts[0].m is not None else None
        return cls(parts[0].type_name, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def rows(self, index: torch.Tensor) -> "GGUFBlockWeight":
        """The same blocks with the output rows reordered (llama.cpp's Q / K row order -> HF's)."""
        return GGUFBlockWeight(self.type_name, self.qs[index], self.d[index],
                               None if self.m is None else self.m[index])

    # -- meaning ---------------------------------------------------------------------------------
    def integers(self) -> torch.Tensor:
        """q [N, K] as int32: int8 for Q8_0, 0..15 for the 4-bit types, weights in order."""
        if self.type_name == "Q8_0":
            return self.qs.view(torch.int8).reshape(self.out_features, -1).int()
        q = torch.cat([self.qs & 15, self.qs >> 4], dim=-1)   # weights 0..15, then 16..31
        return q.reshape(self.out_features, -1).int()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the blocks stand for (computed in fp32, as llama.cpp does)."""
        q = self.integers().float().view(self.out_features, -1, BLOCK)
        d = self.d.float()[..., None]
        if self.type_name == "Q4_1":
            w = q * d + self.m.float()[..., None]
        else:
            w = (q - 8) * d if self.type_name == "Q4_0" else q * d
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    # -- running ---------------------------------------------------------------------------------
    def panels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The same blocks regrouped into panels of 16 rows (gguf_panels.h: one vpdpbusd then
        serves 16 rows): qs [N / 16, K / 32, 16, bytes], d and m [N / 16, K / 32, 16]. Q8_0 codes are
        stored + 128 (unsigned, as vpdpbusd reads them); a Q4 block's 16 bytes are regrouped by
        fours, each group's nibbles kept where they are. None where the kernel cannot run them
        (no AVX512_VNNI in this build, or rows not a multiple of 16). Made once, on first use."""
        if not hasattr(self, "_panels"):
            ext = cpu.load()
            self._panels = None
            if ext is not None and ext.gguf_panels_supported() and self.out_features % 16 == 0:
                p, nb, width = self.out_features // 16, self.in_features // BLOCK, self.qs.shape[2]
                groups = self.qs.view(p, 16, nb, width // 4, 4).permute(0, 2, 3, 1, 4)   # [P, nb, group, row, 4]
                qs = groups.reshape(p, nb, 16, width).contiguous()
                if self.type_name == "Q8_0":
                    qs ^= 0x80
                per_row = (lambda t: t.view(p, 16, nb).transpose(1, 2).contiguous())
                self._panels = (qs, per_row(self.d), self._no_min if self.m is None else per_row(self.m))
        return self._panels

    def matmul(self, x: torch.Tensor, activations: str = "int8") -> torch.Tensor:
        """x [M, K] (float32 or bfloat16, CPU) -> x @ W^T [M, N] in x's dtype, by the C++ kernel."""
        ext = kernels_for(activations)
        return ext.gguf_matmul(x, *self.kernel_blocks(activations), self.ggml_type, activations == "int8")

    def kernel_blocks(self, activations: str = "int8") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qs, d, m) as the kernel runs them fastest: the panels for int8 activations where this
        CPU has them, else the rows (m empty for Q8_0 / Q4_0)."""
        panels = self.panels() if activations == "int8" else None
        return panels or (self.qs, self.d, self._no_min if self.m is None else self.m)

    def emulate_int8(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 kernel's arithmetic in plain torch (float64 sums): rows of x rounded per 32
        to int8 as llama.cpp's quantize_row_q8_0 does, exact integer block dot products, each
        block scaled by d_w * d_x (the fp16 scales), plus m_w * s_x for Q4_1."""
        xq, xd, xs = quantize_activations(x)
        q = self.integers()
        if self.type_name == "Q4_0":
            q = q - 8
        nb = self.in_features // BLOCK
        dots = torch.einsum("mbj,nbj->mnb", xq.view(-1, nb, BLOCK).double(),
                            q.view(-1, nb, BLOCK).double())                     # exact integers
        scale = (self.d.float()[None] * xd.float()[:, None]).double()            # fp32 product, as the kernel
        y = (dots * scale).sum(-1)
        if self.type_name == "Q4_1":
            y = y + (self.m.float()[None] * xs.float()[:, None]).double().sum(-1)
        return y


def kernels_for(activations: str):
    """The built C++ kernels, once `activations` names an arithmetic they run (ValueError) and
    they are available here (RuntimeError)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    ext = cpu.load()
    if ext is None:
        raise RuntimeError("the C++ CPU kernels are not available here (llmopt.kernels.cpu.available())")
    return ext


def file_blocks(data: np.ndarray, type_name: str, row_len: int, types, block: int) -> np.ndarray:
    """A GGUF tensor's bytes [rows, bytes per row] as [rows, row_len / block, bytes per block]
    (a view of the file's map where it can be), once `type_name` is one of `types` and a row
    holds whole blocks of `block` weights."""
    if type_name not in types:
        raise ValueError(f"GGUF block type must be one of {tuple(types)}, got {type_name!r}")
    if row_len % block:
        raise ValueError(f"a {type_name} row holds whole blocks of {block}; {row_len} is not a multiple")
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(data.shape[0], row_len // block, -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 / Q8_1 of each row, per 32 values: d = amax / 127 (kept as fp16),
    q = round_half_even(x * 127 / amax), s = d * sum(q) (fp16). Returns q int8 [M, K], d and s [M, K / 32]."""
    xf = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = xf.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax != 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv)
    s = (d[..., 0] * q.sum(-1)).half().float()
    return q.to(torch.int8).reshape(x.shape), d[..., 0].half().float(), s
