"""NF4, QLoRA's 4-bit data type (Dettmers et al., 2023), and bitsandbytes' checkpoint layout: the format
quantize(method="nf4") writes, and `NF4Linear`, which runs it.

Trained weights are close to normally distributed, so NF4 puts its 16 levels where a normal
distribution puts equal probability mass: at its quantiles, scaled into [-1, 1], with an exact
zero (8 levels on the positive side, 7 on the negative). A block of 64 weights is divided by
its largest |w| (its absmax) and each weight becomes the index of the nearest level:

    w ~ absmax[block] * NF4[q]        q in [0, 16)

Double quantization then shrinks the absmax constants themselves (32 bits per 64 weights =
0.5 bits a weight): their mean is subtracted and they are stored as 8 bits in blocks of 256
with one fp32 scale each, bitsandbytes' dynamic 8-bit map, for 8/64 + 32/(64*256) = 0.127
bits a weight. Storage is 4.127 bits a weight in all, against 4.5 for int4 with an fp16
scale and a 4-bit zero per group of 64.

`to_bnb` writes the tensors bitsandbytes' `Params4bit` serializes and transformers reads
(`quant_method: "bitsandbytes"`): the codes two to a byte (the first in the high nibble),
`absmax`, `quant_map`, the nested statistics, and a JSON `quant_state` packed into bytes.

`NF4Linear` holds what a bitsandbytes checkpoint stores, two codes to a byte, plus one fp32
absmax per block (double quantization is undone once, on loading), and multiplies by lookup. NF4's 16 levels are not
evenly spaced, so no integer kernel can run them; each call instead expands the codes through
a 256-entry table (one byte -> its two levels), scales every block by its absmax and multiplies:
the dense weight exists only for the duration of one layer's matmul, never for the model.

A checkpoint stores one such weight per Hugging Face module (q_proj, k_proj, v_proj, ...), each
with its own quantization state; llmopt fuses q/k/v and gate/up, so every shard is decoded by
itself (`from_bnb`) and placed at its output rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.layers.quant.linear import QuantLinear

NF4_OFFSET = 0.9677083   # QLoRA: the middle of 1 - 1/(2*15) and 1 - 1/(2*16), so +-1 are finite quantiles
NESTED_BLOCKSIZE = 256


def nf4_levels(offset: float = NF4_OFFSET) -> torch.Tensor:
    """The 16 NF4 values, from the definition: normal quantiles, 8 positive, 7 negative and 0,
    divided by the largest (bitsandbytes' create_normal_map)."""
    ndtri = torch.special.ndtri
    pos = ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).float().sort().values
    return v / v.max()


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' dynamic 8-bit map (Dettmers 2016): a sign, a run of zeros that sets the
    decimal exponent, then a fraction; 256 sorted values in [-1, 1]. Double quantization's code."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        b = torch.linspace(0.1, 1, items)
        means = ((b[:-1] + b[1:]) / 2.0) * 10 ** (-(max_exponent_bits - 1) + i)
        data += means.tolist() + ((-means).tolist() if signed else [])
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    return torch.tensor(sorted(data))


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten x, divide each block by its absmax, take the nearest value of `code`:
    (uint8 indices [numel], fp32 absmax [blocks]). A short last block is allowed."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    pad = (-n) % blocksize
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, blocksize)
    absmax = blocks.abs().amax(1)
    normed = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    # nearest level: search the sorted code, then pick the closer of the two neighbours
    code = code.float().to(x.device)
    hi = torch.searchsorted(code, normed.contiguous()).clamp(1, code.numel() - 1)
    lo = hi - 1
    pick = torch.where((normed - code[lo]).abs() <= (code[hi] - normed).abs(), lo, hi)
    return pick.reshape(-1)[:n].to(torch.uint8), absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """code[q] * absmax[block], fp32, flat."""
    values = code.float()[q.long()]
    return values * absmax.float().repeat_interleave(blocksize)[: values.numel()]


@dataclass
class NF4Weight:
    """A weight [out, in] in NF4: codes in [0, 16) and one fp32 absmax per block of `blocksize`
    consecutive weights (row-major, so blocks never cross rows when blocksize divides `in`)."""

    codes: torch.Tensor       # [out, in] uint8
    absmax: torch.Tensor      # [out, in / blocksize] float32
    blocksize: int = 64
    double_quant: bool = True
    quant_type: str = "nf4"

    @classmethod
    def quantize(cls, w: torch.Tensor, blocksize: int = 64, double_quant: bool = True) -> "NF4Weight":
        n, k = w.shape
        if k % blocksize:
            raise ValueError(f"blocksize {blocksize} must divide in_features ({k})")
        q, absmax = quantize_blockwise(w, nf4_levels(), blocksize)
        return cls(q.view(n, k), absmax.view(n, k // blocksize), blocksize, double_quant)

    def rows(self, start: int, end: int) -> "NF4Weight":
        return NF4Weight(self.codes[start:end], self.absmax[start:end], self.blocksize, self.double_quant)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W = absmax * NF4[q] with the first-level absmax (double quantization happens on writing)."""
        w = nf4_levels().to(self.codes.device)[self.codes.long()]
        return (w.view(*self.absmax.shape, -1) * self.absmax[..., None]).view(self.codes.shape).to(dtype)


def to_bnb(w: NF4Weight, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The tensors bitsandbytes writes for one Linear4bit (keys after the module's name)."""
    codes = w.codes.reshape(-1)
    if codes.numel() % 2:
        raise ValueError("bitsandbytes packs two 4-bit codes per byte: the weight needs an even size")
    state = {"quant_type": w.quant_type, "blocksize": w.blocksize,
             "dtype": str(dtype).removeprefix("torch."), "shape": list(w.codes.shape)}
    out = {"weight": ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).view(-1, 1),
           "weight.quant_map": nf4_levels().to(codes.device)}
    absmax = w.absmax.reshape(-1).float()
    if w.double_quant:
        offset = absmax.mean()
        nested = dynamic_map().to(codes.device)
        q, nested_absmax = quantize_blockwise(absmax - offset, nested, NESTED_BLOCKSIZE)
        out.update({"weight.absmax": q, "weight.nested_absmax": nested_absmax,
                    "weight.nested_quant_map": nested})
        state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=offset.item())
    else:
        out["weight.absmax"] = absmax
    out[f"weight.quant_state.bitsandbytes__{w.quant_type}"] = torch.tensor(
        list(json.dumps(state).encode("utf-8")), dtype=torch.uint8)
    return out


def from_bnb(tensors: dict[str, torch.Tensor], what: str = "checkpoint") -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor, int, list]:
    """One Linear4bit's serialized tensors -> (codes [out, in] uint8, absmax [out, in / blocksize]
    fp32, flat, with any double quantization undone, quant_map [16], blocksize, shape)."""
    states = [k for k in tensors if k.startswith("weight.quant_state.bitsandbytes__")]
    if len(states) != 1:
        raise ValueError(f"{what}: a bitsandbytes 4-bit weight needs one weight.quant_state.bitsandbytes__* "
                         f"tensor, found {len(states)}")
    state = json.loads(bytes(tensors[states[0]].to(torch.uint8).tolist()).decode("utf-8"))
    for key in ("weight", "weight.absmax", "weight.quant_map"):
        if key not in tensors:
            raise ValueError(f"{what}: the bitsandbytes 4-bit weight lacks {key!r}")
    shape, blocksize = list(state.get("shape", [])), int(state.get("blocksize", 64))
    if len(shape) != 2 or (shape[0] * shape[1]) % blocksize:
        raise ValueError(f"{what}: quant_state shape {shape} with blocksize {blocksize}: llmopt runs 2-D "
                         "weights made of whole blocks")
    packed = tensors["weight"].reshape(-1)
    if packed.dtype != torch.uint8 or packed.numel() * 2 != shape[0] * shape[1]:
        raise ValueError(f"{what}: weight holds {packed.numel()} {packed.dtype} values; a {shape} weight "
                         "packs into shape[0] * shape[1] / 2 uint8 bytes")
    codes = torch.stack([packed >> 4, packed & 15], -1).reshape(shape)
    absmax = tensors["weight.absmax"].reshape(-1)
    if "nested_offset" in state:
        for key in ("weight.nested_absmax", "weight.nested_quant_map"):
            if key not in tensors:
                raise ValueError(f"{what}: double-quantized absmax without {key!r}")
        absmax = dequantize_blockwise(absmax, tensors["weight.nested_absmax"], tensors["weight.nested_quant_map"],
                                      int(state.get("nested_blocksize", NESTED_BLOCKSIZE))) + state["nested_offset"]
    absmax = absmax.float()
    if absmax.numel() != shape[0] * shape[1] // blocksize:
        raise ValueError(f"{what}: {absmax.numel()} absmax values for {shape} in blocks of {blocksize}")
    quant_map = tensors["weight.quant_map"].float().reshape(-1)
    if quant_map.numel() != 16:
        raise ValueError(f"{what}: quant_map has {quant_map.numel()} values, a 4-bit map has 16")
    return codes, absmax, quant_map, blocksize, shape


# -- the linear that runs it ----------------------------------------------------------------------------
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
