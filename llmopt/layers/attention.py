"""Attention's one home: the cache stores a step's keys and values, attention attends.

Every attention layer calls `attention(q, k, v, meta, kv_cache, layer, ...)`: the cache writes
this step's new keys and values where its layout keeps them (nowhere, a contiguous strip per
sequence, or the slots of a paged pool), then the new queries attend over everything their
sequence has so far. `AttentionMetadata` says, once per step, which sequence owns which of
the flat batch's tokens, and where their keys live (vLLM's attention metadata); the step
builds it once and passes it down, model to layer to attention to cache, as an argument.

New queries sit at the end of their sequence: query j of n new tokens has position
`num_computed + j` and sees every key at or before it (and, with a sliding window,
only the last `window` of those). With GQA each group of `num_queries_per_kv` query heads
reads one shared key/value head.

On a GPU, SDPA's fused kernels do this (`enable_gqa` handles the groups); paged pools are read
by llmopt.layers.paged_attention (torch, the C++ kernel or Triton, fixed when the pool is built).
On the CPU, two plain matmuls per tile of queries beat SDPA for an engine's shapes, more so the
longer the prompt (measured: benchmarks/README.md, "Measurements behind the code's choices"): a
group's query heads are stacked into one matrix, so each kv head's keys are read by one matmul,
never copied per query head; and each tile multiplies only the keys up to its last query,
skipping the half of a causal square the mask would throw away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F



@dataclass
class AttentionMetadata:
    """One step's layout: sequence i brings query_lens[i] new tokens after context_lens[i]
    cached ones; the flat batch holds them one sequence after another.

    Paged pools also need each sequence's block table and each new token's slot
    (block * block_size + offset); a contiguous cache needs each sequence's strip (`slots`).
    """

    query_lens: list[int]
    context_lens: list[int]
    positions: torch.Tensor                          # [num_tokens] position of each new token
    slots: list[int] | None = None                   # contiguous cache: each sequence's strip
    block_tables: list[list[int]] | None = None      # paged: per sequence, its blocks in order
    slot_mapping: torch.Tensor | None = None         # [num_tokens] block * block_size + offset
    block_table_tensor: torch.Tensor | None = None   # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor | None = None      # [num_seqs + 1] int32
    seq_lens_tensor: torch.Tensor | None = None      # [num_seqs] int32
    plans: dict = field(default_factory=dict, repr=False)  # what the caches derive once a step (gathers, indices)
    tree_masks: list | None = None  # draft trees: per sequence a bool [new, context + new] mask, or None
    tree_bits: torch.Tensor | None = None  # ... the same as the kernels read it: [num_tokens] int64, per
    #   query row a bit per new key of its sequence it may see (-1: causal); None when a tree is too big

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @classmethod
    def uncached(cls, query_lens: list[int], device="cpu") -> "AttentionMetadata":
        """Whole sequences, nothing cached before: the naive loop, calibration, perplexity."""
        return cls(list(query_lens), [0] * len(query_lens), _positions([0] * len(query_lens), query_lens, device))

    @classmethod
    def contiguous(cls, slots: list[int], context_lens: list[int], query_lens: list[int],
                   device="cpu") -> "AttentionMetadata":
        """Sequences in the strips `slots` of a ContiguousKVCache, context_lens tokens cached."""
        return cls(list(query_lens), list(context_lens), _positions(context_lens, query_lens, device),
                   slots=list(slots))

    @classmethod
    def paged(cls, tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device="cpu", slot_fn=None) -> "AttentionMetadata":
        """Sequences whose KV lives in the blocks of `tables` (draft models and heads run on
        the same block tables, with KV pools of their own). slot_fn: what maps positions to
        slots (`slots_of`; lesson 02's exercise passes the learner's)."""
        slot_fn = slot_fn or slots_of
        slots, positions = [], []
        for table, start, n in zip(tables, context_lens, query_lens):
            slots += slot_fn(table, range(start, start + n), block_size)
            positions += range(start, start + n)
        width = max(len(t) for t in tables)
        qsl = [0, *accumulate(query_lens)]
        return cls(
            list(query_lens), list(context_lens), host_to_device(positions, torch.long, device),
            block_tables=tables, slot_mapping=host_to_device(slots, torch.long, device),
            block_table_tensor=host_to_device([t + [0] * (width - len(t)) for t in tables], torch.int32, device),
            query_start_loc=host_to_device(qsl, torch.int32, device),
            seq_lens_tensor=host_to_device([c + n for c, n in zip(context_lens, query_lens)], torch.int32, device))


def host_to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A Python list as a tensor on `device`. To a GPU it goes through pinned memory without
    waiting: a copy from ordinary (pageable) memory waits for the GPU to finish all queued work,
    and with the host preparing step n+1 while step n runs (llmopt/engine/overlap.py) that wait
    would undo the overlap."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def slots_of(table: list[int], positions, block_size: int) -> list[int]:
    """Cache slot of each token position of a sequence: block * block_size + offset."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _positions(context_lens, query_lens, device) -> torch.Tensor:
    pos = [p for c, n in zip(context_lens, query_lens) for p in range(c, c + n)]
    return torch.tensor(pos, dtype=torch.long, device=device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_cache,
              layer: int, scale: float, window: int | None = None) -> torch.Tensor:
    """Store this step's keys and values in `kv_cache`, then attend. q: [T, Hq, D]; k, v: [T, Hkv, D];
    `meta` is the step's layout.

    How the cache attends was fixed when it was built (`kv_cache.attend`, one of the functions
    below: whole sequences, contiguous strips, or a paged pool read by torch, the C++ kernel or
    Triton), so nothing here chooses. A cache with a `rotation` R (orthogonal [D, D]:
    PagedKVCache.rotate) is handed k R and v R: (q R).(k R) = q.k, so the scores stay, and the
    output, a mix of turned values, turns back."""
    r = kv_cache.rotation
    if r is not None:
        r = r.to(q.dtype)
        q, k, v = q @ r, k @ r, v @ r
    held = kv_cache.store(layer, k, v, meta)
    if held is not None:  # a cache that keeps nothing may hand back what to read instead
        k, v = held
    out = kv_cache.attend(q, k, v, meta, kv_cache, layer, scale, window)
    return out if r is None else out @ r.T


def whole_sequence_attention(q, k, v, meta, cache, layer: int, scale: float, window=None):
    """Every sequence is whole in this step (no cache): its keys are this step's."""
    starts = [0, *accumulate(meta.query_lens)]
    return torch.cat([sequence_attention(q[s:e], k[s:e], v[s:e], scale, window) for s, e in zip(starts, starts[1:])])


class KVCache:
    """What every cache offers the attention layers: `store`, and how attention reads what it
    keeps (`attend`), both handed the step's metadata. The caches themselves (none, contiguous,
    paged, MLA's latent pool) live with the pools, in llmopt/worker/kv_cache.py."""

    layout = "none"   # how keys are kept: "none", "contiguous", "paged" (or "latent": MLA)
    rotation: torch.Tensor | None = None   # [D, D] orthogonal: attention hands over k R, v R (PagedKVCache.rotate)
    # how attention reads what this cache keeps: a cache that keeps
    # nothing holds whole sequences, whose keys are the step's own
    attend = staticmethod(whole_sequence_attention)

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Account for the step before the model runs (a contiguous cache moves its strips'
        lengths; a cache that keeps nothing checks the step is whole sequences). Nothing of
        `meta` is kept: every layer is handed it."""

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        """Keep this step's new keys and values [num_tokens, Hkv, D] of `layer`. A cache that keeps
        nothing may return the (keys, values) attention should read instead (an emulation of a
        lossy cache does: keys rounded as an FP8 pool would hold them); None: read this step's."""


def contiguous_attention(q, k, v, meta, cache, layer: int, scale: float, window=None):
    """Over the strips K, V [max_seqs, Hkv, max_len, D] of a ContiguousKVCache, which already
    hold this step's keys."""
    K, V = cache.k[layer], cache.v[layer]
    if meta.is_decode:  # every sequence brings one token: attend in one batched call
        idx = torch.tensor(meta.slots, device=K.device)
        lens = torch.tensor(meta.seq_lens, device=K.device)
        Lmax = max(meta.seq_lens)
        return batched_decode_attention(q, K[idx, :, :Lmax], V[idx, :, :Lmax], lens, scale, window)
    outs, start = [], 0
    for slot, total, n in zip(meta.slots, meta.seq_lens, meta.query_lens):
        outs.append(sequence_attention(q[start:start + n], K[slot, :, :total].transpose(0, 1),
                                       V[slot, :, :total].transpose(0, 1), scale, window))
        start += n
    return torch.cat(outs)


# -- the attention math, one sequence or one batch of decodes ----------------------------------------

# Queries per tile on the CPU path: small enough that a tile's scores stay in cache and the
# causal skipping is fine-grained, large enough that each matmul is worth its call.
QUERY_TILE = 64
SUBNORMAL_GAP = 80.0  # e^-80 is a normal float32; e^-88 and below are not


def causal_mask(n_query: int, n_key: int, window: int | None, device) -> torch.Tensor:
    """Boolean [n_query, n_key] mask, True where a query may attend to a key."""
    return _allowed(n_key - n_query, n_key, 0, n_key, window, device)


def _allowed(q_start: int, q_end: int, k_start: int, k_end: int, window: int | None, device) -> torch.Tensor:
    """Boolean mask of queries at positions q_start..q_end-1 over keys at k_start..k_end-1."""
    q_pos = torch.arange(q_start, q_end, device=device)[:, None]
    k_pos = torch.arange(k_start, k_end, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       window: int | None = None) -> torch.Tensor:
    """One sequence. q: [n, Hq, D] (its newest n tokens); k, v: [L, Hkv, D], L >= n."""
    if q.device.type == "cpu":
        return _tiled_attention(q, k, v, scale, window)
    n, L = q.shape[0], k.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if window is None and n == L:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif window is None and n == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    else:
        mask = causal_mask(n, L, window, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    L, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    keys_t = k.permute(1, 2, 0)                 # [Hkv, D, L]: a transposed view, no copy
    values = v.transpose(0, 1)                  # [Hkv, L, D]
    grouped = q.view(n, num_kv_heads, group, head_dim).transpose(0, 1)   # [Hkv, n, G, D]
    out = q.new_empty(num_kv_heads, n, group, head_dim)
    first = L - n                               # position of the first new query
    for s in range(0, n, QUERY_TILE):
        e = min(n, s + QUERY_TILE)
        hi = first + e                          # keys after the tile's last query: never seen
        lo = 0 if window is None else max(0, first + s - window + 1)   # ... nor before its window
        rows = (e - s) * group
        scores = torch.bmm(grouped[:, s:e].reshape(num_kv_heads, rows, head_dim), keys_t[:, :, lo:hi])
        scores = scores.view(num_kv_heads, e - s, group, hi - lo)
        allowed = _allowed(first + s, first + e, lo, hi, window, q.device)
        # softmax in fp32 whatever the model's dtype, as fused attention kernels accumulate
        scores = (scores.float() * scale).masked_fill_(~allowed[None, :, None, :], float("-inf"))
        # Keys scoring more than SUBNORMAL_GAP below their row's best get probability exactly 0
        # rather than exp(-88...-104): subnormal floats, which x86 cores compute far slower than
        # normal ones, so a layer where such scores appear attended far slower than one without
        # (measured: benchmarks/README.md, "Measurements behind the code's choices"). e^-80 = 2e-35 is
        # far below what a float32 sum of the row's probabilities (the largest is e^0 = 1) or
        # of their weighted values can register, so the output does not change.
        floor = scores.amax(-1, keepdim=True) - SUBNORMAL_GAP
        probs = scores.masked_fill_(scores < floor, float("-inf")).softmax(-1)
        out[:, s:e] = torch.bmm(probs.to(q.dtype).view(num_kv_heads, rows, hi - lo),
                                values[:, lo:hi]).view(num_kv_heads, e - s, group, head_dim)
    return out.transpose(0, 1).reshape(n, num_heads, head_dim)


def batched_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float,
                             window: int | None = None) -> torch.Tensor:
    """One new token per sequence, all sequences in one call.

    q: [B, Hq, D]; k, v: [B, Hkv, Lmax, D] padded per sequence; seq_lens: [B] valid keys.
    """
    L = k.shape[2]
    k_pos = torch.arange(L, device=q.device)[None, :]
    allowed = k_pos < seq_lens[:, None]
    if window is not None:
        allowed &= k_pos >= seq_lens[:, None] - window
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=allowed[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)
