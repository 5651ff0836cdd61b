"""The paged pool for multi-head latent attention: one row of latent + RoPE key per token.

A Llama layer's pool holds K and V, 2 x num_kv_heads x head_dim numbers per token; an MLA
layer's holds one row of kv_lora_rank + qk_rope_head_dim numbers, whatever the number of
heads (llmopt/layers/mla.py says why that is enough). Blocks, block tables, slot mapping,
prefix sharing and preemption are the block manager's, exactly as for every other model:
only what a slot holds differs. llmopt/layers/mla.py attends over it.
"""

from __future__ import annotations

import torch

from llmopt.kernels import triton_usable
from llmopt.kernels.mla_attention import write_latent
from llmopt.layers.mla import MLAConfig
from llmopt.worker.kv_cache import KVCache


class MLAPagedKVCache(KVCache):
    """Per layer, a pool `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`."""

    layout = "latent"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, mla: MLAConfig,
                 dtype: torch.dtype = torch.float32, device="cpu", kv_cache_dtype="auto", kernels: bool = True):
        if kv_cache_dtype not in ("auto", dtype) and not (kv_cache_dtype == "bfloat16" and dtype == torch.bfloat16):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: the latent cache of an MLA model is kept in "
                             "the model's dtype (no FP8 or narrower latent cache here); allowed: 'auto'")
        self.dtype = self.cache_dtype = dtype
        self.width = mla.kv_lora_rank + mla.qk_rope_head_dim
        # empty, not zeros: a slot is written before anything reads it (see PagedKVCache)
        self.kv = [torch.empty(num_blocks, block_size, self.width, dtype=dtype, device=device)
                   for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.use_triton = kernels and torch.device(device).type == "cuda" and triton_usable(device)

    is_fp8 = False

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, mla: MLAConfig, dtype: torch.dtype) -> int:
        width = mla.kv_lora_rank + mla.qk_rope_head_dim
        return num_layers * block_size * width * torch.empty((), dtype=dtype).element_size()

    def bytes_per_token(self) -> int:
        """Measured from the pool itself: every layer's bytes over its slots."""
        return sum(t.numel() * t.element_size() for t in self.kv) // (self.num_blocks * self.block_size)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst takes block src's latent rows, every layer (see PagedKVCache.copy_blocks)."""
        src = torch.tensor([s for s, _ in pairs], device=self.kv[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.kv[0].device)
        for pool in self.kv:
            pool[dst] = pool[src]

    def store(self, layer, k, v, meta):
        raise TypeError("an MLA pool holds latent rows, not keys and values: the model's attention "
                        "must call store_latent (llmopt/layers/mla.py)")

    def store_latent(self, layer: int, kv: torch.Tensor, meta) -> None:
        write_latent(kv, self.kv[layer], meta.slot_mapping)
