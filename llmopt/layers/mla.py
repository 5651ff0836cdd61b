"""Multi-head latent attention (MLA, DeepSeek-V2/V3): cache one small latent per token.

    latent c = RMSNorm(W_DKV x)   (kv_lora_rank numbers)    k_pe = RoPE(W_KR x)  (shared by all heads)
    head h:  k = [W_UK[h] c, k_pe]      v = W_UV[h] c       q = [q_nope[h], RoPE(q_pe[h])]

The cache keeps [c, k_pe] per token and layer, kv_lora_rank + qk_rope_head_dim numbers
(576 for DeepSeek-V3) where multi-head attention would keep 2 x 128 heads x 128 (32,768).
Rebuilding K and V for every cached token at every step would cost more than it saves, so
the up-projections are absorbed (DeepSeek-V2, section 2.1.2): W_UK[h] multiplies into the
query (q_latent = W_UK[h]^T q_nope[h], R numbers), attention runs over the cached rows
themselves (llmopt.kernels.mla_attention), and W_UV[h] multiplies the R-wide output.
vLLM does this for decode and re-expands K and V for long prefills, where the absorbed
form's R-wide dot products cost more FLOPs than the nope + rope ones; here one form serves
both, so a prompt computed in chunks or whole reads exactly the same cached rows.

DeepSeek lays each RoPE pair out interleaved, (x0, x1), (x2, x3)...; `rope_interleave`
de-interleaves first, so the rotate-half RoPE of llmopt.layers.rotary applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmopt.kernels.mla_attention import latent_attention, mla_attention, mla_attention_ref
from llmopt.layers.norm import RMSNorm


@dataclass
class MLAConfig:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3): K and V come from a
    kv_lora_rank latent, plus a qk_rope_head_dim RoPE key shared by all heads."""

    kv_lora_rank: int
    q_lora_rank: int | None     # None: q is one plain projection
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    softmax_scale: float = 1.0  # qk_head_dim^-0.5, times YaRN's mscale^2 when it applies


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): pairs become (i, i + d/2)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, attention_bias: bool = False):
        """cfg: the model's ModelConfig (its hidden size, heads, and `mla` shapes)."""
        super().__init__()
        m = cfg.mla
        self.layer_idx, self.cfg = layer_idx, m
        self.num_heads = cfg.num_attention_heads
        self.qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        hidden, H = cfg.hidden_size, self.num_heads
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * self.qk_head_dim, bias=False)
        else:  # q through its own low-rank bottleneck (saves activations in training, not KV)
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, hidden, bias=attention_bias)

    def forward(self, meta, x, rotary, kv_cache):
        m, H = self.cfg, self.num_heads
        T, R = x.shape[0], m.kv_lora_rank
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, self.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([R, m.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.view(T, 1, m.qk_rope_head_dim)
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = rotary(meta.positions, q_pe, k_pe)
        # absorb W_UK into the query: [H, nope, R] per head, q_latent = q_nope @ W_UK
        w_kv = self.kv_b_proj.weight.view(H, m.qk_nope_head_dim + m.v_head_dim, R)
        w_uk, w_uv = w_kv[:, :m.qk_nope_head_dim], w_kv[:, m.qk_nope_head_dim:]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        out_latent = latent_cache_attention(torch.cat([q_latent, q_pe], -1), torch.cat([latent, k_pe[:, 0]], -1),
                                            meta, kv_cache, self.layer_idx, R, m.softmax_scale)
        # ... and W_UV into the output: each head's R-wide result to its v_head_dim values
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv)
        return self.o_proj(out.reshape(T, H * m.v_head_dim))


def latent_cache_attention(q: torch.Tensor, kv: torch.Tensor, meta, kv_cache, layer: int, kv_lora_rank: int,
                           scale: float) -> torch.Tensor:
    """Store this step's latent rows kv [T, R + r] in the cache, then attend q [T, H, R + r] over
    each sequence's rows -> [T, H, R]. A paged latent pool is read through the block tables
    (the Triton kernel on CUDA, its torch reference elsewhere); with no cache, every sequence
    is whole in this step."""
    if kv_cache.layout not in ("latent", "none"):
        raise TypeError(f"{type(kv_cache).__name__} keeps keys and values per head; an MLA model (DeepSeek) "
                        "needs a latent cache: the paged engine's MLAPagedKVCache, or NoKVCache")
    kv_cache.store_latent(layer, kv, meta)
    if kv_cache.layout == "latent":
        pool = kv_cache.kv[layer]
        if kv_cache.use_triton:
            return mla_attention(q.contiguous(), pool, meta.block_table_tensor, meta.query_start_loc,
                                 meta.seq_lens_tensor, kv_lora_rank, scale, max_query_len=max(meta.query_lens))
        return mla_attention_ref(q, pool, meta.block_table_tensor, meta.query_start_loc, meta.seq_lens_tensor,
                                 kv_lora_rank, scale)
    outs, start = [], 0
    for n in meta.query_lens:
        outs.append(latent_attention(q[start:start + n], kv[start:start + n], kv_lora_rank, scale))
        start += n
    return torch.cat(outs)
