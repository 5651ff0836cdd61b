"""NF4, QLoRA's 4-bit data type (Dettmers et al., 2023), and bitsandbytes' checkpoint layout: the runtime
format NF4Linear reads (llmopt/layers/quant/nf4_linear.py) and quantize(method="nf4") writes.

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

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
