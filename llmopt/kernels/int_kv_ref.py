"""A KV cache below 8 bits (kv_cache_dtype="int8" | "int4"), in plain torch: the format, the
write, the read. The C++ kernels (llmopt/kernels/cpu/int_kv.h) do the same arithmetic and are
tested equal to these functions bit for bit.

KIVI's grouping (Liu et al., 2024): keys and values have different outliers, so they are grouped
differently.
  - Keys have a few large *channels* (the same ones at every token), so keys share their
    quantization per channel over the tokens of a block: one group per (block, KV head, channel).
  - Values have no fixed outlier channels but vary by token, so values share it per token over
    groups of channels: one group per (slot, KV head, VALUE_GROUP[bits] channels).
The two widths quantize differently, each where its budget is:
  - int8: symmetric codes, q = clamp(round(x / s), -127, 127), read back q * s, s a power of two
    stored as one byte (an exponent biased by 127: E8M0, the shared scale of the OCP Microscaling
    formats), the smallest with amax / s <= 127. One byte a group, not two, is what lets int8 hold
    1.9x the tokens of bf16 with its scales counted (`bytes_per_token`); int8 has precision to spare.
  - int4: asymmetric codes, q = clamp(round((x - m) / s), 0, 15), read back q * s + m, with the
    group's minimum m and s = (max - min) / 15 both float16 (two codes a byte: channel j < D / 2 in
    byte j's low nibble, channel D / 2 + j in its high nibble, so a read unpacks two contiguous halves). Sixteen levels cannot spare any: a range that is not centred on zero (a key channel's
    offset) would waste half of a symmetric grid, and a power-of-two scale up to half of what is left.
A block fills a token (or a chunk) at a time, so a key channel's group is known only from the
tokens written so far: when new tokens fall outside it, the block's earlier codes of that channel
are re-expressed on the wider grid (read back, quantized again) and the group grows. A block's first
write (offset 0) starts afresh. Values need nothing of the kind.
"""

from __future__ import annotations

import torch

INT_KV_DTYPES = {"int8": torch.int8, "int4": torch.uint8}  # the pools' storage (int4: two codes a byte)
VALUE_GROUP = {8: 32, 4: 64}  # value channels sharing one group, per token
SCALE_BIAS = 127              # E8M0: the byte e + 127 means 2^e, bytes 1 to 254 (2^-126 .. 2^127) used


def int_kv_bits(cache_dtype: torch.dtype) -> int | None:
    """8 or 4 for an int pool's storage dtype, None for any other pool."""
    return {torch.int8: 8, torch.uint8: 4}.get(cache_dtype)


def code_width(head_dim: int, bits: int) -> int:
    """Bytes of one KV head's codes for one token."""
    return head_dim * bits // 8


def scale_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, bits: int):
    """(shape, dtype) of the keys' groups [blocks, Hkv, D(, 2)] and the values' [blocks, block_size,
    Hkv, D / VALUE_GROUP(, 2)]: int8 one E8M0 byte, int4 a float16 pair (scale, minimum)."""
    g = head_dim // VALUE_GROUP[bits]
    if bits == 8:
        return ((num_blocks, num_kv_heads, head_dim), torch.uint8), ((num_blocks, block_size, num_kv_heads, g), torch.uint8)
    return ((num_blocks, num_kv_heads, head_dim, 2), torch.float16), \
        ((num_blocks, block_size, num_kv_heads, g, 2), torch.float16)


def bytes_per_token(num_kv_heads: int, head_dim: int, bits: int, block_size: int) -> float:
    """Bytes one token's K and V take in one layer, codes and groups: the keys' groups are spread
    over a block's tokens, the values' are the token's own."""
    group_bytes = 1 if bits == 8 else 4
    codes = 2 * num_kv_heads * code_width(head_dim, bits)
    return codes + group_bytes * num_kv_heads * head_dim * (1 / block_size + 1 / VALUE_GROUP[bits])


# -- int8: symmetric, E8M0 scales ------------------------------------------------------------------

def scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte of the smallest power of two s with amax / s <= 127 (uint8; amax 0, or below
    float32's normal range, takes the smallest, 2^-126, and rounds to codes 0)."""
    m, e = torch.frexp(amax.float() / 127)   # amax / 127 = m * 2^e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)      # an exact power of two needs no more
    return torch.where(amax > 0, e + SCALE_BIAS, 1).clamp(1, 254).to(torch.uint8)


def scale_value(byte: torch.Tensor) -> torch.Tensor:
    """An E8M0 byte as the float32 power of two it stands for (the byte is that float's exponent field)."""
    return (byte.int() << 23).view(torch.float32)


def quantize8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """clamp(round(x / scale), -127, 127) as int8 (round half to even, as the kernels round)."""
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)


# -- int4: asymmetric, float16 scale and minimum ---------------------------------------------------

def group_of(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The float16 pair (s, m) of a group spanning lo..hi: s = (hi - lo) / 15, m = lo, each rounded."""
    return torch.stack(((hi - lo) / 15, lo), -1).half()


def quantize4(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """clamp(round((x - m) / s), 0, 15) as uint8 (0 where s is 0: every number of the group is m)."""
    s, m = group[..., 0].float(), group[..., 1].float()
    q = torch.round((x.float() - m) / torch.where(s > 0, s, 1.0)).clamp(0, 15)
    return torch.where(s > 0, q, 0.0).to(torch.uint8)


def dequantize4(codes: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """q * s + m in float32 (a product, then a sum: two roundings, as the kernels do it)."""
    return codes.float() * group[..., 0].float() + group[..., 1].float()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., D] as the pool stores them: int8 as they are; int4 (0..15) two a byte [..., D / 2],
    the first half of the channels in the low nibbles, the second in the high."""
    if bits == 8:
        return codes
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """The pool's bytes back to codes [..., D] (int8, or uint8 0..15)."""
    if bits == 8:
        return stored
    return torch.cat((stored & 15, stored >> 4), -1)


# -- the write and the read ----------------------------------------------------------------------

def write_int_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 k_scales: torch.Tensor, v_scales: torch.Tensor, slot_mapping: torch.Tensor, bits: int) -> None:
    """Store new tokens' keys and values in an int pool (the module's docstring says how).

    k, v: [T, Hkv, D]; k_pool, v_pool: [num_blocks, block_size, Hkv, D * bits / 8]; k_scales and
    v_scales as `scale_shapes` gives them. A step's tokens of one block arrive together and in order
    of their positions (one sequence's consecutive tokens), as the engine writes them."""
    T, H, D = k.shape
    bs, G = k_pool.shape[1], VALUE_GROUP[bits]
    slots = slot_mapping.long()
    blocks, offsets = slots // bs, slots % bs
    # values: per token and group of channels
    vg = v.float().view(T, H, D // G, G)
    if bits == 8:
        vgroup = scale_bytes(vg.abs().amax(-1))                                  # [T, H, D / G]
        vcodes = quantize8(vg, scale_value(vgroup)[..., None]).view(T, H, D)
    else:
        vgroup = group_of(vg.amin(-1), vg.amax(-1))                              # [T, H, D / G, 2]
        vcodes = quantize4(vg, vgroup[..., None, :]).view(T, H, D)
    v_pool.view(-1, H, v_pool.shape[-1]).index_copy_(0, slots, pack(vcodes, bits))
    v_scales.view(-1, *v_scales.shape[2:]).index_copy_(0, slots, vgroup)
    # keys: per block and channel, over the step's tokens of that block and the ones before them
    touched, which = torch.unique_consecutive(blocks, return_inverse=True)
    first = torch.full((len(touched),), bs, dtype=torch.long).scatter_reduce_(0, which, offsets, "amin")
    before = (first > 0)[:, None, None]                   # the block holds earlier tokens
    index = which[:, None, None].expand(-1, H, D)
    kf = k.float()
    if bits == 8:
        amax = torch.zeros(len(touched), H, D).scatter_reduce_(0, index, kf.abs(), "amax")
        old = torch.where(before, k_scales[touched], torch.zeros((), dtype=torch.uint8))
        new = torch.maximum(old, scale_bytes(amax))                              # [B, H, D]
        grown = (new > old) & before
        if grown.any():  # earlier codes of these channels: divided by 2^(new - old), rounded again
            codes = unpack(k_pool[touched], bits).float()                        # [B, bs, H, D]
            codes = torch.round(codes * (scale_value(old) / scale_value(new))[:, None])
            earlier = (torch.arange(bs)[None, :] < first[:, None])[:, :, None, None] & grown[:, None]
            k_pool[touched] = torch.where(earlier, codes.to(torch.int8), k_pool[touched])
        k_scales[touched] = new
        kcodes = quantize8(kf, scale_value(new)[which])
    else:
        lo = torch.full((len(touched), H, D), float("inf")).scatter_reduce_(0, index, kf, "amin")
        hi = torch.full((len(touched), H, D), float("-inf")).scatter_reduce_(0, index, kf, "amax")
        old = k_scales[touched].float()                                          # [B, H, D, 2]
        old_lo, old_hi = old[..., 1], old[..., 0] * 15 + old[..., 1]
        lo = torch.where(before, torch.minimum(lo, old_lo), lo)
        hi = torch.where(before, torch.maximum(hi, old_hi), hi)
        grown = before & ((lo < old_lo) | (hi > old_hi))
        new = torch.where((grown | ~before)[..., None], group_of(lo, hi), k_scales[touched])
        if grown.any():  # earlier codes of these channels: read back on the old grid, quantized on the new
            codes = unpack(k_pool[touched], bits)                                # [B, bs, H, D]
            requant = quantize4(dequantize4(codes, k_scales[touched][:, None]), new[:, None])
            earlier = (torch.arange(bs)[None, :] < first[:, None])[:, :, None, None] & grown[:, None]
            k_pool[touched] = pack(torch.where(earlier, requant, codes), bits)
        k_scales[touched] = new
        kcodes = quantize4(kf, new[which])
    k_pool.view(-1, H, k_pool.shape[-1]).index_copy_(0, slots, pack(kcodes, bits))


def read_keys(k_pool: torch.Tensor, k_scales: torch.Tensor, blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """Whole blocks of keys in float32: [len(blocks), block_size, Hkv, D]."""
    codes = unpack(k_pool[blocks], bits)
    if bits == 8:
        return codes.float() * scale_value(k_scales[blocks])[:, None]
    return dequantize4(codes, k_scales[blocks][:, None])


def read_values(v_pool: torch.Tensor, v_scales: torch.Tensor, blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """Whole blocks of values in float32: [len(blocks), block_size, Hkv, D]."""
    codes = unpack(v_pool[blocks], bits)
    n, bs, H, D = codes.shape
    G = VALUE_GROUP[bits]
    grouped = codes.view(n, bs, H, D // G, G)
    if bits == 8:
        return (grouped.float() * scale_value(v_scales[blocks])[..., None]).view(n, bs, H, D)
    return dequantize4(grouped, v_scales[blocks][..., None, :]).view(n, bs, H, D)
