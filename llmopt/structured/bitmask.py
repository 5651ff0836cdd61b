"""The allowed-token bitmask as the sampler applies it: one bit per token, 32 tokens a word.

A grammar says which tokens may come next as an int32 bitmask [B, ceil(V / 32)] (xgrammar's
layout, and vLLM's and SGLang's); before sampling, every disallowed token's logit becomes -inf.
The model runner applies it, so this file sits on the layers' floor (docs/structure.md).
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [B, ceil(V / 32)] -> bool [B, V]: bit j of word w allows token 32 * w + j
    (xgrammar's layout, and vLLM's and SGLang's)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Structured outputs: a copy of `logits` in which row rows[i] keeps only the tokens that
    bitmask[i] allows (the rest -inf). It comes before temperature, top-k and top-p, so a draw
    is from the model's distribution renormalized over the allowed tokens, then filtered."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = masked[index].masked_fill(~allowed, float("-inf"))
    return masked
