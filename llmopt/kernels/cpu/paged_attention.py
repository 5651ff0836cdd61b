"""Paged attention on the CPU that reads the KV pool where it lies, one pass per step.

The torch path gathers every sequence's keys and values into a padded copy before attending;
this C++ kernel (paged_attention.cpp) follows the block table instead, reading each key and
value row once for all the query heads that share it (GQA), slicing long contexts across
threads and merging their partial softmaxes (flash-decoding). `paged_attention_ref`
(llmopt.kernels.paged_attention) is the plain-torch meaning it is tested against, and what
runs where the C++ kernels cannot be built.
"""

from __future__ import annotations

import torch

from llmopt.kernels import cpu
from llmopt.kernels.paged_attention import FP8_DTYPES
from llmopt.kernels.paged_attention_ref import paged_attention_ref

QUERY_DTYPES = (torch.float32, torch.bfloat16)
POOL_DTYPES = (torch.float32, torch.bfloat16) + FP8_DTYPES + (torch.int8, torch.uint8)  # int4: uint8, two a byte
NO_SCALES = torch.empty(0, dtype=torch.uint8)


def paged_attention_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, window: int | None = None,
                        k_scale: float = 1.0, v_scale: float = 1.0,
                        tree_bits: torch.Tensor | None = None, batch_invariant: bool = False,
                        k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of flat queries over paged keys and values; returns [T, Hq, D] in q's dtype.

    q: [T, Hq, D] float32 or bfloat16, the new tokens of every sequence one after another;
    sequence i owns rows query_start_loc[i] .. query_start_loc[i + 1] (a decode owns one).
    k_pool, v_pool: [num_blocks, block_size, Hkv, D], float32, bfloat16 or float8 (e4m3fn /
    e5m2, read as fp8 * k_scale / v_scale); Hq a multiple of Hkv (query head h reads kv head
    h // (Hq / Hkv)). block_table: [B, max_blocks] int32, the blocks of each sequence in order;
    query_start_loc: [B + 1] int32; seq_lens: [B] int32, each sequence's length after this step
    (its context plus its new tokens, whose keys and values are already in the pool). The
    queries of a sequence with n new tokens sit at positions seq_len - n .. seq_len - 1 and see
    the keys at positions <= their own, and > their own minus `window` when one is given.
    Softmax and sums run in fp32. Slots no query may see are never read.

    tree_bits: [T] int64 or None, a draft tree's mask (llmopt/spec/draft_tree.py `mask_bits`):
    bit j of row t set when query t may see the key at seq_len - 64 + j of its sequence, -1 for
    a causal row. A tree row sees every earlier key and, of the last 64, those bits only.

    An int8 pool (int8 codes) or int4 pool (uint8, two codes a byte: [..., D / 2]) comes with its
    groups, k_scales and v_scales (llmopt/kernels/int_kv_ref.py `scale_shapes`), and is read as
    codes times their scale (plus their minimum, int4).

    batch_invariant: each query row's arithmetic independent of the rest of the call (the other
    sequences, its own tile of queries, the threads): long contexts are cut into slices at fixed
    key positions and every row merged the same way (paged_attention.cpp). Off, the slices follow
    the step's work and one-token rows take their own vector path: faster, and a row's last bits
    may change with its neighbours.
    """
    for name, t, dtypes in (("q", q, QUERY_DTYPES), ("k_pool", k_pool, POOL_DTYPES), ("v_pool", v_pool, POOL_DTYPES)):
        if t.dtype not in dtypes or t.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU tensor of {dtypes}, got {t.dtype} on {t.device}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if tree_bits is not None and (tree_bits.dtype != torch.int64 or tree_bits.shape != (q.shape[0],)):
        raise ValueError(f"tree_bits must be int64 [{q.shape[0]}] (one per query row), got "
                         f"{tree_bits.dtype} {tuple(tree_bits.shape)}")
    if (k_pool.dtype in (torch.int8, torch.uint8)) != (k_scales is not None and v_scales is not None):
        raise ValueError("k_scales and v_scales go with an int8 / int4 pool, and only with one")
    ext = cpu.load()
    if ext is None:
        return paged_attention_ref(q, k_pool, v_pool, block_table, query_start_loc, seq_lens, scale,
                                   window, k_scale, v_scale, tree_bits, k_scales, v_scales)
    return ext.paged_attention(q.contiguous(), k_pool, v_pool, block_table, query_start_loc, seq_lens,
                               float(scale), 0 if window is None else window, float(k_scale), float(v_scale),
                               torch.empty(0, dtype=torch.int64) if tree_bits is None else tree_bits.contiguous(),
                               bool(batch_invariant), NO_SCALES if k_scales is None else k_scales,
                               NO_SCALES if v_scales is None else v_scales)
