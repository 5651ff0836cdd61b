"""The plain-torch meaning of paged attention (llmopt/kernels/paged_attention.py says the layout):
one sequence at a time, its keys and values gathered through its block table, a masked softmax.
The Triton kernels and the C++ CPU kernel are tested against it."""

from __future__ import annotations

import torch


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float,
                        sliding_window: int | None = None,
                        k_scale: float = 1.0, v_scale: float = 1.0,
                        tree_bits: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: one sequence at a time, gather its keys and values, masked softmax.

    Keys and values are read as fp32 times their scale (1.0 for a cache in the model's dtype).
    tree_bits ([T] int64, a draft tree's mask): a row other than -1 sees, of its sequence's last
    64 keys, only those whose bit is set (bit j: the key at seq_len - 64 + j).
    An int8 / int4 pool is read as its codes times k_scales / v_scales (llmopt/kernels/int_kv_ref.py).
    """
    from llmopt.kernels.int_kv_ref import int_kv_bits, read_keys, read_values

    bits = int_kv_bits(k_cache.dtype)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for i in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        seq_len, query_len = int(seq_lens[i]), end - start

        # Follow the block table: the sequence's blocks, in order, then drop the unused
        # tail of its last block.
        blocks = block_tables[i, :(seq_len + block_size - 1) // block_size].long()
        if bits is None:
            k = k_cache[blocks].flatten(0, 1)[:seq_len].float() * k_scale   # [seq_len, Hkv, D]
            v = v_cache[blocks].flatten(0, 1)[:seq_len].float() * v_scale
        else:
            k = read_keys(k_cache, k_scales, blocks, bits).flatten(0, 1)[:seq_len]
            v = read_values(v_cache, v_scales, blocks, bits).flatten(0, 1)[:seq_len]
        k = k.repeat_interleave(group, dim=1)                      # GQA: [seq_len, Hq, D]
        v = v.repeat_interleave(group, dim=1)

        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        if tree_bits is not None:
            rows = tree_bits[start:end].to(q.device)[:, None]
            j = k_pos - (seq_len - 64)                             # index among the last 64 keys
            seen = ((rows >> j.clamp(min=0)) & 1).bool()
            allowed &= (rows == -1) | (j < 0) | seen

        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
