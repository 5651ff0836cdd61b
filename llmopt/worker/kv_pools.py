"""The engine's KV pool: what one block costs, and the pool that holds `num_blocks` of them.

Three shapes of pool, one per kind of model and engine:
  - a Llama-family model in one process: K and V per layer and KV head (`PagedKVCache`);
  - DeepSeek's MLA: one latent row plus a RoPE key per token and layer (`MLAPagedKVCache`);
  - tensor/pipeline parallel: every rank holds its share of the same blocks (its stage's
    layers, its KV heads), allocated by the executor on each rank.
An FP8 pool also needs its per-layer K/V scales: calibrated on sample text when asked,
else read from the checkpoint, else 1.0.
"""

from __future__ import annotations

import torch

from llmopt.worker.kv_cache import PagedKVCache
from llmopt.worker.kv_scales import calibration_token_ids
from llmopt.worker.mla_cache import MLAPagedKVCache


def bytes_per_block(model_config, block_size: int, kv_dtype: torch.dtype, executor=None) -> int:
    """Bytes of one block of `block_size` tokens, on one rank."""
    cfg = model_config
    if cfg.mla is not None:  # DeepSeek: one latent row per token and layer, not K and V
        return MLAPagedKVCache.bytes_per_block(cfg.num_hidden_layers, block_size, cfg.mla, kv_dtype)
    # with parallel workers, one rank's share of a block: its stage's layers, its KV heads
    layers, kv_heads = ((cfg.num_hidden_layers, cfg.num_key_value_heads) if executor is None
                        else (executor.kv_layers, executor.kv_heads))
    return PagedKVCache.bytes_per_block(layers, block_size, kv_heads, cfg.head_dim, kv_dtype)


def build_kv_pool(engine):
    """The pool of `engine.num_blocks` blocks for the engine's model, FP8 scales set."""
    cfg, config = engine.model_config, engine.config
    if engine.executor is not None:  # every rank allocates its share of the same blocks
        pool = engine.executor.init_kv_cache(engine.num_blocks)
    elif cfg.mla is not None:
        pool = MLAPagedKVCache(cfg.num_hidden_layers, engine.num_blocks, engine.block_size,
                               cfg.mla, engine.dtype, engine.device, config.kv_cache_dtype,
                               kernels=not config.enforce_eager)
    else:  # enforce_eager=True: attention in plain torch too, no kernel
        pool = PagedKVCache(cfg.num_hidden_layers, engine.num_blocks, engine.block_size,
                            cfg.num_key_value_heads, cfg.head_dim, engine.dtype, engine.device,
                            engine.kv_cache_dtype, kernels=not config.enforce_eager)
    if pool.is_fp8:  # per-layer K/V scales: calibrated, else the checkpoint's, else 1.0
        if config.calculate_kv_scales:
            pool.calibrate(engine.model, calibration_token_ids(
                engine.tokenizer, seq_len=min(512, engine.max_model_len)))
        else:
            pool.load_scales(engine.model_path)
    return pool
