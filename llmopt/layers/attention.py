"""Causal self-attention over a sequence's cached keys and values, in plain torch.

New queries sit at the end of their sequence: query j of n new tokens has position
`num_computed + j` and sees every key at or before it (and, with a sliding window,
only the last `window` of those). GQA is handled by SDPA's `enable_gqa`: each group
of `num_queries_per_kv` query heads reads one shared key/value head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(n_query: int, n_key: int, window: int | None, device) -> torch.Tensor:
    """Boolean [n_query, n_key] mask, True where a query may attend to a key."""
    q_pos = torch.arange(n_key - n_query, n_key, device=device)[:, None]
    k_pos = torch.arange(n_key, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       window: int | None = None) -> torch.Tensor:
    """One sequence. q: [n, Hq, D] (its newest n tokens); k, v: [L, Hkv, D], L >= n."""
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
