"""Running a model over one step's flat batch: every forward loop in llmopt goes through here.

The step's `AttentionMetadata` (llmopt.layers.attention) says which sequence owns which new
token and where its keys and values are kept; the cache accounts for the step first, then the
model runs once over all new tokens (`input_ids` [num_tokens]), `meta` passed to every layer.
"""

from __future__ import annotations

import torch


def run_model(model, kv_cache, input_ids, meta) -> torch.Tensor:
    """Hidden states [num_tokens, hidden] of `model` for the step `meta` over `kv_cache`."""
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.tensor(input_ids, dtype=torch.long, device=meta.positions.device)
    kv_cache.begin_step(meta)
    return model(input_ids, meta, kv_cache)
