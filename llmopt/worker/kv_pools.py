"""The engine's KV pool: what one block costs, and the pool that holds `num_blocks` of them.

Three shapes of pool, one per kind of model and engine:
  - a Llama-family model in one process: K and V per layer and KV head (`PagedKVCache`);
  - DeepSeek's MLA: one latent row plus a RoPE key per token and layer (`MLAPagedKVCache`);
  - tensor/pipeline parallel: every rank holds its share of the same blocks (its stage's
    layers, its KV heads), allocated by each rank's worker (llmopt/distributed/worker.py);
    `bytes_per_block` prices one rank's share.
An FP8 pool also needs its per-layer K/V scales (`set_kv_scales`): calibrated on sample text
when asked, else read from the checkpoint, else 1.0.
"""

from __future__ import annotations

import torch

from llmopt.fp8.kv_scales import calibration_token_ids
from llmopt.worker.kv_cache import PagedKVCache, kv_cache_torch_dtype
from llmopt.worker.mla_cache import MLAPagedKVCache


def bytes_per_block(model_config, block_size: int, kv_dtype: torch.dtype,
                    layers: int | None = None, kv_heads: int | None = None) -> int:
    """Bytes of one block of `block_size` tokens. With parallel workers, one rank's share:
    `layers` (its stage's) and `kv_heads` (its own) instead of the model's."""
    cfg = model_config
    if cfg.mla is not None:  # DeepSeek: one latent row per token and layer, not K and V
        return MLAPagedKVCache.bytes_per_block(cfg.num_hidden_layers, block_size, cfg.mla, kv_dtype)
    return PagedKVCache.bytes_per_block(layers or cfg.num_hidden_layers, block_size,
                                        kv_heads or cfg.num_key_value_heads, cfg.head_dim, kv_dtype)


def build_kv_pool(model_config, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                  kv_cache_dtype: str, kernels: bool = True):
    """The pool of `num_blocks` blocks for one process's model (`kv_cache_dtype`: "auto" or an
    FP8 name; `kernels=False`, as with enforce_eager=True: attention in plain torch, no kernel)."""
    cfg = model_config
    if cfg.mla is not None:
        return MLAPagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.mla, dtype, device,
                               kv_cache_dtype, kernels=kernels)
    return PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                        dtype, device, kv_cache_torch_dtype(kv_cache_dtype, dtype), kernels=kernels)


def set_kv_scales(pool, calculate: bool | str, model, tokenizer, model_path, max_model_len: int,
                  rotation: str | None = None) -> None:
    """An FP8 pool's K/V scales: calibrated on sample text (`calculate`: True or "tensor" one per
    layer, "attn_head" one per KV head; `rotation` "hadamard" turns keys and values first), else the
    checkpoint's, else 1.0. A pool in the model's own dtype needs none."""
    if not pool.is_fp8:
        return
    if calculate:
        pool.calibrate(model, calibration_token_ids(tokenizer, seq_len=min(512, max_model_len)),
                       per_head=calculate == "attn_head", rotate=rotation == "hadamard")
    else:
        pool.load_scales(model_path)
