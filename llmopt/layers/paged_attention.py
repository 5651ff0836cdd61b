"""Paged attention: attending over a pool of fixed-size blocks whose slots already hold this step's keys.

A paged pool is [num_blocks, block_size, Hkv, D] per layer (llmopt/worker/kv_cache.py); each
sequence's keys are found through its block table. Three implementations, one signature
`(q, k, v, meta, cache, layer, scale, window)`, and a pool picks one when it is built
(`pick_paged_attention`):

    torch   decodes gathered in groups of similar length into one padded batch each (one SDPA
            call per group), prompts and chunks one at a time: the reference, and all that
            enforce_eager=True runs;
    cpu     the C++ kernel (llmopt/kernels/cpu/paged_attention.cpp) follows the block tables,
            each key read once for its query heads, long contexts split across threads;
    triton  the Triton kernels (llmopt/kernels/paged_attention.py), on CUDA.

An FP8 pool is read as fp8 * scale; an int8 / int4 pool as codes times their group scales
(llmopt/kernels/int_kv_ref.py), by the C++ kernel or, in torch, a sequence's blocks at a time.
A draft tree's step (`meta.tree_masks`) goes through the kernels under their 64-bit masks
(`meta.tree_bits`), and through the masked torch path where the tree is too large for them: the
one choice made per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.kernels import cpu
from llmopt.kernels.cpu.paged_attention import POOL_DTYPES, QUERY_DTYPES, paged_attention_cpu
from llmopt.kernels.int_kv_ref import read_keys, read_values
from llmopt.kernels.paged_attention import FP8_DTYPES, SUPPORTED_HEAD_DIMS
from llmopt.kernels.paged_attention import paged_attention as paged_attention_triton
from llmopt.layers.attention import AttentionMetadata, causal_mask, sequence_attention


def paged_attention_kernel_cpu(q, k, v, meta, cache, layer: int, scale: float, window=None):
    """The C++ kernel reads the block tables directly."""
    if meta.tree_masks is not None and (meta.tree_bits is None or window is not None):  # step choice: attention
        return paged_attention_torch(q, k, v, meta, cache, layer, scale, window)
    ints = {} if cache.int_bits is None else dict(k_scales=cache.k_scales[layer], v_scales=cache.v_scales[layer])
    return paged_attention_cpu(q, cache.k[layer], cache.v[layer], meta.block_table_tensor, meta.query_start_loc,
                               meta.seq_lens_tensor, scale, window, cache.k_scale[layer], cache.v_scale[layer],
                               tree_bits=meta.tree_bits, **ints)


def paged_attention_kernel_triton(q, k, v, meta, cache, layer: int, scale: float, window=None):
    """The Triton kernels read the block tables directly."""
    if meta.tree_masks is not None and (meta.tree_bits is None or window is not None):  # step choice: attention
        return paged_attention_torch(q, k, v, meta, cache, layer, scale, window)
    return paged_attention_triton(q, cache.k[layer], cache.v[layer], meta.block_table_tensor, meta.query_start_loc,
                                  meta.seq_lens_tensor, scale, window, max_query_len=max(meta.query_lens),
                                  k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer],
                                  tree_bits=meta.tree_bits)


def pick_paged_attention(device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                         kernels: bool = True) -> str:
    """Which paged attention a pool reads with, decided once when it is built: the kernels
    where they run these dtypes and head sizes (`kernels=False`: the torch path, enforce_eager)."""
    device = torch.device(device)
    if not kernels:
        return "torch"
    # the Triton kernels cover the head sizes real models use, pools in the model's dtype or FP8
    # (a float32 model's bfloat16 pool takes torch there)
    if device.type == "cuda":
        usable = head_dim in SUPPORTED_HEAD_DIMS and (cache_dtype == dtype or cache_dtype in FP8_DTYPES)
        return "triton" if usable else "torch"
    usable = dtype in QUERY_DTYPES and cache_dtype in POOL_DTYPES and device.type == "cpu"
    return "cpu" if usable and cpu.available() else "torch"


def paged_attention_torch(q, k, v, meta, cache, layer: int, scale: float, window=None):
    """The torch path: decodes gathered in groups of similar length into one padded batch each
    (one SDPA call per group), prompts and chunks one at a time; draft trees under their masks.
    It is the kernels' reference too."""
    if getattr(cache, "int_bits", None) is not None:
        return paged_int_attention(q, meta, cache, layer, scale, window)
    K, V, ks, vs = cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer]
    block_size = cache.block_size
    if meta.tree_masks is not None:  # step choice: attention (a draft tree's masks)
        return paged_masked_attention(q, K, V, ks, vs, meta, block_size, scale, window)
    decode_groups, prefills = _torch_plan(meta, block_size, K.shape[2], q.dtype, K.device)
    out = torch.empty_like(q)
    num_kv_heads, head_dim = K.shape[2], K.shape[3]
    for tokens, gather, mask, lens, L in decode_groups:
        # each group's keys and values as a padded [B, Hkv, L, D] batch (index_select is the
        # fastest gather torch has on CPU), then one SDPA call
        B = tokens.shape[0]
        kg = _read(K.view(-1, head_dim), gather, ks, q.dtype, (B, num_kv_heads, L, head_dim))
        vg = _read(V.view(-1, head_dim), gather, vs, q.dtype, (B, num_kv_heads, L, head_dim))
        if window is not None:  # sliding window: only the last `window` keys of each sequence
            pos = torch.arange(L, device=q.device)
            mask = mask.masked_fill((pos[None, :] < lens[:, None] - window)[:, None, None, :], float("-inf"))
        out[tokens] = F.scaled_dot_product_attention(q[tokens].unsqueeze(2), kg, vg, attn_mask=mask,
                                                     scale=scale, enable_gqa=True).squeeze(2)
    fp8 = K.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    for s, e, ctx, blocks in prefills:
        if blocks is None and not fp8:  # a whole prompt: its keys are this step's keys
            keys, values = k[s:e], v[s:e]
        elif blocks is None:            # ... as the FP8 pool holds them, so chunked == unchunked
            slots = meta.slot_mapping[s:e].long()
            keys = _read(K.view(-1, *K.shape[2:]), slots, ks, q.dtype)
            values = _read(V.view(-1, *V.shape[2:]), slots, vs, q.dtype)
        else:                           # a chunk after cached context: read the context from the blocks
            keys = _read(K, blocks, ks, q.dtype).flatten(0, 1)[:ctx + e - s]
            values = _read(V, blocks, vs, q.dtype).flatten(0, 1)[:ctx + e - s]
        out[s:e] = sequence_attention(q[s:e], keys, values, scale, window)
    return out


def paged_masked_attention(q, K, V, ks, vs, meta: AttentionMetadata, block_size: int, scale: float,
                           window=None):
    """A step with explicit masks (draft-tree verification, llmopt/spec/draft_tree.py): each
    sequence's keys are read from its blocks in slot order and its queries attend where its
    mask allows (a sequence without one: causal). Slot order need not be position order here;
    keys carry their positions already (RoPE was applied before they were stored). Two matmuls
    with each group's query heads stacked, as in _tiled_attention (SDPA's masked CPU path is slower)."""
    out = torch.empty_like(q)
    num_kv_heads, head_dim = K.shape[2], K.shape[3]
    group = q.shape[1] // num_kv_heads
    start = 0
    for i, (n, total) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        blocks = torch.tensor(meta.block_tables[i][:-(-total // block_size)], device=q.device)
        keys = _read(K, blocks, ks, q.dtype).flatten(0, 1)[:total]      # [L, Hkv, D]
        values = _read(V, blocks, vs, q.dtype).flatten(0, 1)[:total]
        mask = meta.tree_masks[i]
        if mask is None:
            mask = causal_mask(n, total, window, q.device)
        elif window is not None:
            raise ValueError("draft-tree steps do not support sliding-window attention")
        grouped = q[start:start + n].view(n, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.bmm(grouped.reshape(num_kv_heads, n * group, head_dim), keys.permute(1, 2, 0))
        scores = (scores.view(num_kv_heads, n, group, total).float() * scale).masked_fill_(
            ~mask[None, :, None, :], float("-inf"))
        probs = scores.softmax(-1).to(q.dtype).view(num_kv_heads, n * group, total)
        heads = torch.bmm(probs, values.transpose(0, 1)).view(num_kv_heads, n, group, head_dim)
        out[start:start + n] = heads.transpose(0, 1).reshape(n, -1, head_dim)
        start += n
    return out


def paged_int_attention(q, meta: AttentionMetadata, cache, layer: int, scale: float, window=None):
    """An int8 / int4 pool in torch: each sequence's blocks dequantized (codes times their scales,
    llmopt/kernels/int_kv_ref.py), then its queries attend causally (or under its draft tree's mask)."""
    out = torch.empty_like(q)
    bits, block_size = cache.int_bits, cache.block_size
    num_kv_heads = cache.k[layer].shape[2]
    start = 0
    for i, (n, total) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        blocks = torch.tensor(meta.block_tables[i][:-(-total // block_size)], device=q.device)
        keys = read_keys(cache.k[layer], cache.k_scales[layer], blocks, bits).flatten(0, 1)[:total].to(q.dtype)
        values = read_values(cache.v[layer], cache.v_scales[layer], blocks, bits).flatten(0, 1)[:total].to(q.dtype)
        mask = None if meta.tree_masks is None else meta.tree_masks[i]
        if mask is None:
            out[start:start + n] = sequence_attention(q[start:start + n], keys, values, scale, window)
        else:
            group = q.shape[1] // num_kv_heads
            k_, v_ = keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float()
            scores = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), k_) * scale
            probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
            out[start:start + n] = torch.einsum("hqk,khd->qhd", probs, v_).to(q.dtype)
        start += n
    return out


# a pool's choice (`pick_paged_attention`) -> the function it reads with
PAGED_ATTENTION = {"torch": paged_attention_torch, "cpu": paged_attention_kernel_cpu,
                   "triton": paged_attention_kernel_triton}


# Decodes are attended in groups of similar length: the torch path pads each group to its
# longest context, so sorting by length first keeps the padding small.
DECODE_GROUP = 16


def _torch_plan(meta: AttentionMetadata, block_size: int, num_kv_heads: int, dtype, device):
    """The torch path's gathers and masks, worked out once per step (not once per layer) and
    kept on the metadata for every pool of the same shape."""
    key = (block_size, num_kv_heads, dtype, str(device))
    if key in meta.plans:
        return meta.plans[key]
    seq_lens = meta.seq_lens
    decode = sorted((i for i, n in enumerate(meta.query_lens) if n == 1), key=seq_lens.__getitem__)
    starts = meta.query_start_loc[:-1].long()
    groups = []
    for g in range(0, len(decode), DECODE_GROUP):
        rows = decode[g:g + DECODE_GROUP]
        index = torch.tensor(rows, device=device)
        lens = meta.seq_lens_tensor.long()[index]
        L = seq_lens[rows[-1]]  # rows are sorted by length: the group's longest
        tables = meta.block_table_tensor[index, :-(-L // block_size)].long()
        # Each sequence's slots for positions 0..L-1; positions past its own length (the
        # group's padding) re-read its position 0, a written slot, and are masked out.
        pos = torch.arange(L, device=device)
        valid = pos[None, :] < lens[:, None]
        slots = tables[:, pos // block_size] * block_size + pos % block_size
        slots = torch.where(valid, slots, slots[:, :1])
        # The pool viewed as rows of head_dim numbers, ordered (sequence, kv head, position):
        # one gather gives each group a contiguous [B, Hkv, L, D].
        heads = torch.arange(num_kv_heads, device=device)
        gather = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
        mask = torch.zeros(len(rows), 1, 1, L, dtype=dtype, device=device).masked_fill_(
            ~valid[:, None, None, :], float("-inf"))
        groups.append((starts[index], gather, mask, lens, L))
    # Prompts and prompt chunks: where their queries sit, and (after cached context) which
    # blocks hold their keys.
    prefills, start = [], 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if n > 1:
            blocks = None
            if ctx:
                blocks = torch.tensor(meta.block_tables[i][:-(-(ctx + n) // block_size)], device=device)
            prefills.append((start, start + n, ctx, blocks))
        start += n
    meta.plans[key] = groups, prefills
    return groups, prefills


def _read(pool: torch.Tensor, index: torch.Tensor, scale, dtype, shape=None) -> torch.Tensor:
    """pool[index] along dim 0 (viewed as `shape`), in the model's dtype: as stored (a bfloat16
    pool of a float32 model widened, exactly), or fp8 * scale.
    A scale per KV head [Hkv, 1] (or per head and channel [Hkv, D]) broadcasts over [..., Hkv, D],
    and over a decode group's [B, Hkv, L, D] as [Hkv, 1, 1 or D]."""
    if pool.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raw = pool.index_select(0, index).to(dtype)
        return raw if shape is None else raw.view(shape)
    # gather the bytes (every device gathers uint8; not every one gathers float8), then widen
    raw = pool.view(torch.uint8).index_select(0, index).view(pool.dtype)
    if shape is not None:
        raw = raw.view(shape)
        scale = scale[:, None] if isinstance(scale, torch.Tensor) else scale
    return (raw.float() * scale).to(dtype)
