"""The paged pool for multi-head latent attention: one row of latent + RoPE key per token.

A Llama layer's pool holds K and V, 2 x num_kv_heads x head_dim numbers per token; an MLA
layer's holds one row of kv_lora_rank + qk_rope_head_dim numbers, whatever the number of
heads (llmopt/layers/mla.py says why that is enough). Blocks, block tables, slot mapping,
prefix sharing and preemption are the block manager's, exactly as for every other model:
only what a slot holds differs. On CUDA the Triton kernel attends; on CPU its torch reference.
"""

from __future__ import annotations

import torch

from llmopt.engine.kv_cache import KVCache, PagedBatch
from llmopt.kernels import triton_usable
from llmopt.kernels.mla_attention import mla_attention, mla_attention_ref, write_latent
from llmopt.model.config import MLAConfig


class MLAPagedKVCache(KVCache):
    """Per layer, a pool `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, mla: MLAConfig,
                 dtype: torch.dtype = torch.float32, device="cpu", kv_cache_dtype="auto"):
        if kv_cache_dtype not in ("auto", dtype):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: an FP8 latent cache is not implemented "
                             "for MLA models; allowed: 'auto'")
        self.dtype = self.cache_dtype = dtype
        self.width = mla.kv_lora_rank + mla.qk_rope_head_dim
        # empty, not zeros: a slot is written before anything reads it (see PagedKVCache)
        self.kv = [torch.empty(num_blocks, block_size, self.width, dtype=dtype, device=device)
                   for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.use_triton = torch.device(device).type == "cuda" and triton_usable(device)

    is_fp8 = False

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, mla: MLAConfig, dtype: torch.dtype) -> int:
        width = mla.kv_lora_rank + mla.qk_rope_head_dim
        return num_layers * block_size * width * torch.empty((), dtype=dtype).element_size()

    def bytes_per_token(self) -> int:
        """Measured from the pool itself: every layer's bytes over its slots."""
        return sum(t.numel() * t.element_size() for t in self.kv) // (self.num_blocks * self.block_size)

    def begin_step(self, batch: PagedBatch) -> None:
        self.batch = batch

    def attend(self, layer, q, k, v, scale, window=None):
        raise TypeError("an MLA pool holds latent rows, not keys and values: the model's attention "
                        "must call attend_latent")

    def attend_latent(self, layer, q, kv, kv_lora_rank, scale):
        b, pool = self.batch, self.kv[layer]
        write_latent(kv, pool, b.slot_mapping)
        if self.use_triton:
            return mla_attention(q.contiguous(), pool, b.block_table_tensor, b.query_start_loc,
                                 b.seq_lens_tensor, kv_lora_rank, scale, max_query_len=max(b.query_lens))
        return mla_attention_ref(q, pool, b.block_table_tensor, b.query_start_loc, b.seq_lens_tensor,
                                 kv_lora_rank, scale)
