"""GGUF k-quant weights (Q4_K, Q6_K) kept in their super-blocks of 256, multiplied as llama.cpp does.

A k-quant tensor is rows of super-blocks: 256 weights, one fp16 scale d (and for Q4_K one fp16
dmin), and small integer scales per sub-block inside the same bytes (llmopt/quant/kquants.py
documents the layouts):

    Q4_K  144 bytes: 8 sub-blocks of 32, 6-bit sc_j and m_j   w = d * sc_j * q - dmin * m_j, q in 0..15
    Q6_K  210 bytes: 16 sub-blocks of 16, int8 sc_j           w = d * sc_j * (q - 32),      q in 0..63

`KQuantWeight` keeps each super-block's bytes exactly as the file stores them (qs uint8
[N, K / 256, 144 or 210]; nothing split out, nothing requantized) and `matmul` runs the C++ kernel
(llmopt/kernels/cpu/kquant_matmul.cpp). It has the interface of `GGUFBlockWeight`, the 32-weight
types' class (llmopt.kernels.cpu.gguf_blocks), so `GGUFLinear` and the compiled decode step take
either.

One weight may stack row ranges ("parts") of the two types: a Q4_K_M file mixes them inside one
fused layer (attn_q and attn_k Q4_K, attn_v Q6_K in some layers), and both kernels read x as
the same int8 codes, so the stack still runs in one kernel call, each range by its own row
kernel into its own columns of y. The alternative, a dense copy of the whole qkv_proj wherever
its parts differ, would read 16 or 32 bits a weight instead of 4.5 to 6.6 (2.4 to 7 times the
bytes) at every decode step, in about half the layers of a Q4_K_M file.

With `activations="int8"` (the default, llama.cpp's arithmetic) each row of x is first rounded
per 256 values to int8 (llama.cpp's Q8_K: one fp32 scale, with the sums of each 16 codes) and
sub-block dot products are exact integer sums; `emulate_int8` computes the same thing in plain
torch. `activations="float32"` multiplies the exact weights by unrounded x. `dequantize` is
the plain-torch meaning of the bytes, equal to `gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
import torch

from llmopt.kernels.cpu.gguf_blocks import file_blocks, kernels_for

QK_K = 256
KQUANT_TYPES = {"Q4_K": 12, "Q6_K": 14}        # llama.cpp's ggml_type numbers
SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
MIXED = -1                                     # the ggml_type of a stack of both


class KQuantWeight:
    """A [N, K] weight as GGUF k-quant super-blocks: `qs` the file's bytes, uint8 [N, K / 256,
    144 or 210] for one type; a stack of row ranges of both types holds them back to back in
    one flat uint8 tensor, `parts` naming each range's type and number of rows, in order."""

    def __init__(self, type_name: str, qs: torch.Tensor):
        if type_name not in KQUANT_TYPES:
            raise ValueError(f"k-quant type must be one of {tuple(KQUANT_TYPES)}, got {type_name!r}")
        size = SUPER_BLOCK_BYTES[type_name]
        if qs.dtype != torch.uint8 or qs.dim() != 3 or qs.shape[2] != size:
            raise ValueError(f"{type_name} super-blocks must be uint8 [N, K / 256, {size}], got "
                             f"{qs.dtype} {tuple(qs.shape)}")
        self.assign(qs.contiguous(), ((type_name, qs.shape[0]),), qs.shape[1] * QK_K)

    def assign(self, qs: torch.Tensor, parts: tuple[tuple[str, int], ...], in_features: int):
        """What the constructor sets, also for a stack of row ranges (`from_pieces`): bytes and parts."""
        self.qs, self.parts = qs, parts
        self.in_features, self.out_features = in_features, sum(rows for _, rows in parts)
        names = list(dict.fromkeys(name for name, _ in parts))
        self.type_name = "+".join(names)                     # "Q4_K", "Q6_K", or "Q4_K+Q6_K" (row order)
        self.ggml_type = KQUANT_TYPES[names[0]] if len(names) == 1 else MIXED
        # the scales live inside the super-blocks: the kernels' d and m arguments stay empty
        self.d = self.m = torch.empty(0, dtype=torch.float16)

    @classmethod
    def from_pieces(cls, pieces: list[tuple[str, torch.Tensor]]) -> "KQuantWeight":
        """Row ranges (type name, qs [rows, K / 256, bytes]) stacked in order, neighbours of one
        type merged into one range."""
        merged: list[tuple[str, list[torch.Tensor]]] = []
        for name, qs in pieces:
            if merged and merged[-1][0] == name:
                merged[-1][1].append(qs)
            else:
                merged.append((name, [qs]))
        if len(merged) == 1:
            return cls(merged[0][0], torch.cat(merged[0][1]))
        w = cls.__new__(cls)
        flat = torch.cat([t.reshape(-1) for _, ts in merged for t in ts])
        w.assign(flat, tuple((name, sum(t.shape[0] for t in ts)) for name, ts in merged), pieces[0][1].shape[1] * QK_K)
        return w

    @classmethod
    def from_gguf_bytes(cls, data: np.ndarray, type_name: str, row_len: int) -> "KQuantWeight":
        """A tensor's bytes as the file stores them, [rows, bytes per row] -> its super-blocks."""
        blocks = file_blocks(data, type_name, row_len, KQUANT_TYPES, QK_K)
        return cls(type_name, torch.from_numpy(blocks.copy()))

    def blocks(self) -> list[tuple[str, torch.Tensor]]:
        """Each part as (type name, its super-blocks uint8 [rows, K / 256, bytes]): views of `qs`."""
        if len(self.parts) == 1:
            return [(self.parts[0][0], self.qs)]
        out, start, nsb = [], 0, self.in_features // QK_K
        for name, rows in self.parts:
            size = rows * nsb * SUPER_BLOCK_BYTES[name]
            out.append((name, self.qs[start:start + size].view(rows, nsb, SUPER_BLOCK_BYTES[name])))
            start += size
        return out

    @classmethod
    def cat(cls, parts: list["KQuantWeight"]) -> "KQuantWeight":
        """Weights stacked by rows (q, k, v into qkv_proj; gate, up into gate_up_proj), of either
        type: a stack of both keeps each range's bytes and runs each by its own kernel."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("only weights of one width stack into one kernel")
        return cls.from_pieces([piece for p in parts for piece in p.blocks()])

    def rows(self, index: torch.Tensor) -> "KQuantWeight":
        """The same super-blocks with the output rows reordered (llama.cpp's Q / K row order ->
        HF's): row i of the result is row index[i] of this weight."""
        index = torch.as_tensor(index, dtype=torch.long)
        if len(self.parts) == 1:  # one type (an embedding's lookup, every step): rows of qs
            return KQuantWeight(self.type_name, self.qs[index])
        names = [name for name, _ in self.parts]
        kind = torch.cat([torch.full((rows,), i) for i, (_, rows) in enumerate(self.parts)])
        local = torch.cat([torch.arange(rows) for _, rows in self.parts])
        blocks = [qs for _, qs in self.blocks()]
        pieces, start = [], 0
        part_of = kind[index]
        for end in [*(torch.nonzero(part_of[1:] != part_of[:-1]).flatten() + 1).tolist(), len(index)]:
            p = int(part_of[start])
            pieces.append((names[p], blocks[p][local[index[start:end]]]))
            start = end
        return KQuantWeight.from_pieces(pieces)

    # -- meaning ---------------------------------------------------------------------------------
    def integers(self) -> torch.Tensor:
        """The stored codes q [N, K] as int32, weights in order: 0..15 for Q4_K, 0..63 for Q6_K."""
        return torch.cat([decode(name, qs)["q"].reshape(qs.shape[0], -1) for name, qs in self.blocks()])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the super-blocks stand for, in fp32 as gguf.quants computes it:
        (d * sc) * q - dmin * m for Q4_K, (d * sc) * (q - 32) for Q6_K, each product rounded."""
        out = []
        for name, qs in self.blocks():
            v = decode(name, qs)
            q = v["q"].view(*qs.shape[:2], v["sc"].shape[-1], -1).float()            # [N, S, J, sub-block]
            if name == "Q4_K":
                w = (v["d"][..., None] * v["sc"].float())[..., None] * q - (v["dmin"][..., None] * v["m"].float())[..., None]
            else:
                w = (v["d"][..., None] * v["sc"].float())[..., None] * (q - 32)
            out.append(w.reshape(qs.shape[0], self.in_features))
        return torch.cat(out).to(dtype)

    def nbytes(self) -> int:
        return self.qs.numel()

    # -- running ---------------------------------------------------------------------------------
    def matmul(self, x: torch.Tensor, activations: str = "int8") -> torch.Tensor:
        """x [M, K] (float32 or bfloat16, CPU) -> x @ W^T [M, N] in x's dtype, by the C++ kernel."""
        ext = kernels_for(activations)
        kinds, rows = self.kernel_parts()
        return ext.kquant_matmul(x, self.qs, kinds, rows, activations == "int8")

    def kernel_blocks(self, activations: str = "int8") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qs, d, m) as the kernel takes them: the super-blocks, d and m empty (no panels here:
        the AVX512_VNNI panels of gguf_panels.h are the 32-weight types')."""
        return self.qs, self.d, self.m

    def kernel_parts(self) -> tuple[list[int], list[int]]:
        """The parts as the kernel takes them: their ggml types and row counts, in order."""
        return [KQUANT_TYPES[name] for name, _ in self.parts], [rows for _, rows in self.parts]

    def emulate_int8(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 kernel's arithmetic in plain torch (float64 sums): rows of x rounded per 256
        as llama.cpp's quantize_row_q8_K does, exact integer sub-block dot products and minimum
        (Q4_K) or offset (Q6_K) terms per super-block, each scaled by the fp32 products d_w * d_x
        (and dmin_w * d_x), as the kernel scales them."""
        xq, xd, bsums = quantize_activations_k(x)
        m_rows, nsb = x.shape[0], self.in_features // QK_K
        xq = xq.view(m_rows, nsb, -1).double()                                  # [M, S, 256]
        out = []
        for name, qs in self.blocks():
            v = decode(name, qs)
            group = 32 if name == "Q4_K" else 16
            q = v["q"].double().view(qs.shape[0], nsb, -1, group)              # [N, S, J, group]
            dots = torch.einsum("msjg,nsjg->mnsj", xq.view(m_rows, nsb, -1, group), q)
            sums = bsums.double().view(m_rows, nsb, -1, group // 16).sum(-1)    # x's sum per sub-block
            if name == "Q6_K":
                dots = dots - 32 * sums[:, None]
            main = (dots * v["sc"].double()).sum(-1)                            # exact integers [M, N, S]
            y = (main * (v["d"][None] * xd[:, None]).double()).sum(-1)
            if name == "Q4_K":
                mins = (sums[:, None] * v["m"].double()).sum(-1)
                y = y - (mins * (v["dmin"][None] * xd[:, None]).double()).sum(-1)
            out.append(y)
        return torch.cat(out, dim=1)


def decode(type_name: str, qs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Super-blocks uint8 [N, S, bytes] -> their numbers: d (and dmin) fp32 [N, S]; the
    sub-block scales sc (Q4_K 0..63 [N, S, 8]; Q6_K int8 [N, S, 16]) and Q4_K's minima m;
    the codes q [N, S, 256] in weight order (uint8)."""
    n, s = qs.shape[:2]
    f16 = (lambda at: qs[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float())
    if type_name == "Q4_K":
        sc_bytes = qs[..., 4:16].int()
        low, mid, top = sc_bytes[..., 0:4], sc_bytes[..., 4:8], sc_bytes[..., 8:12]
        sc = torch.cat([low & 63, (top & 15) | ((low >> 6) << 4)], -1)
        m = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], -1)
        nib = qs[..., 16:].view(n, s, 4, 32)                                     # chunk c: sub-blocks 2c, 2c+1
        q = torch.stack([nib & 15, nib >> 4], dim=3).reshape(n, s, QK_K)
        return {"d": f16(0), "dmin": f16(2), "sc": sc, "m": m, "q": q}
    ql, qh = qs[..., :128].view(n, s, 2, 1, 64), qs[..., 128:192].view(n, s, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(n, s, 2, 128)             # r // 64 picks the nibble
    high = torch.cat([(qh >> k) & 3 for k in (0, 2, 4, 6)], dim=3).reshape(n, s, 2, 128)
    q = (low | (high << 4)).reshape(n, s, QK_K)
    return {"d": f16(208), "sc": qs[..., 192:208].contiguous().view(torch.int8), "q": q}


def quantize_activations_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_K of each row, per 256 values: max = the value of largest magnitude (the
    first), iscale = -127 / max, q = round_half_even(x * iscale) (at most 127), d = 1 / iscale in
    fp32; bsums the sums of each 16 codes. Returns q int8 [M, K], d fp32 [M, K / 256], bsums int16
    [M, K / 16]."""
    xf = x.float().reshape(x.shape[0], -1, QK_K)
    mx = xf.gather(-1, xf.abs().argmax(-1, keepdim=True))                       # argmax: the first maximum
    zero, one = mx == 0, torch.ones_like(mx)
    # true IEEE divisions, as C's: a Python number over a tensor is reciprocal() times it in torch
    iscale = torch.where(zero, 0.0, torch.div(torch.full_like(mx, -127.0), torch.where(zero, one, mx)))
    q = torch.round(xf * iscale).clamp(max=127)
    d = torch.where(zero, 0.0, torch.div(one, torch.where(zero, one, iscale)))[..., 0]
    bsums = q.view(x.shape[0], -1, 16).sum(-1)
    return q.to(torch.int8).reshape(x.shape), d, bsums.to(torch.int16)
