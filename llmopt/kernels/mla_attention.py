"""Paged MLA attention: every head attends over one cached latent per token.

Multi-head latent attention (DeepSeek-V2/V3) caches, per token and layer, a latent `c`
(kv_lora_rank numbers) and a RoPE key `k_pe` (qk_rope_head_dim numbers) shared by all
heads. Head h's key would be [W_UK[h] c, k_pe] and its value W_UV[h] c; multiplying the
up-projections into the query and the output instead ("absorption", DeepSeek-V2 paper
section 2.1.2, vLLM's MLA backend) leaves attention over the cached rows themselves:

    score(h, t) = (W_UK[h]^T q_nope[h]) . c_t + q_pe[h] . k_pe_t      (q_latent = [that, q_pe])
    out[h]      = sum_t p(h, t) c_t          then W_UV[h] out[h] outside this kernel

So MLA is multi-query attention with key = the whole cached row [c, k_pe] (R + r wide)
and value = its first R numbers, the latent. The pool is `[num_blocks, block_size, R + r]`;
block tables, `query_start_loc` and `seq_lens` mean what they mean in paged_attention.py.

`mla_attention_ref` says it in plain torch (the engine's CPU path); the Triton kernel
`mla_attention` computes the same for any mix of prompts, chunks and decodes, one program
per (sequence, tile of query rows), a row being one (query token, head) pair: all heads of
a token read the same keys, so they share every key tile the program loads.
"""

from __future__ import annotations

import torch

from llmopt.kernels import HAS_TRITON

MIN_DOT = 16  # tl.dot needs every dimension >= 16 on a GPU


def write_latent(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' rows [num_tokens, R + r] at their slots (block * block_size + offset)."""
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping.long(), kv.to(kv_cache.dtype))


def latent_attention(q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """One sequence: q [n, H, R + r] (its newest n tokens), kv [L, R + r] -> [n, H, R].

    Causal: query j sits at position L - n + j. Computed in fp32."""
    n, L = q.shape[0], kv.shape[0]
    kv32 = kv.float()
    scores = torch.einsum("qhd,kd->hqk", q.float(), kv32) * scale
    q_pos = torch.arange(L - n, L, device=q.device)[:, None]
    k_pos = torch.arange(L, device=q.device)[None, :]
    probs = scores.masked_fill(k_pos > q_pos, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,kr->qhr", probs, kv32[:, :kv_lora_rank]).to(q.dtype)


def mla_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int,
                      scale: float) -> torch.Tensor:
    """The reference: one sequence at a time, gather its rows through the block table."""
    block_size = kv_cache.shape[1]
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        blocks = block_tables[i, :(seq_len + block_size - 1) // block_size].long()
        kv = kv_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
        out[start:end] = latent_attention(q[start:end], kv, kv_lora_rank, scale)
    return out


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mla_kernel(out_ptr, q_ptr, kv_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
                    scale, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                    stride_block, stride_slot, stride_table,
                    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                    RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if tile * BLOCK_M >= query_len * NUM_HEADS:
            return  # the grid is sized for the longest sequence
        seq_len = tl.load(seq_lens_ptr + seq)

        # Row r of the tile is (token r // NUM_HEADS, head r % NUM_HEADS) of this sequence.
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < query_len * NUM_HEADS
        tok = rows // NUM_HEADS
        head = rows % NUM_HEADS
        q_pos = seq_len - query_len + tok
        r_dims = tl.arange(0, RANK_PAD)
        p_dims = tl.arange(0, ROPE_PAD)
        q_row = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
        q_lat = tl.load(q_ptr + q_row[:, None] + r_dims[None, :],
                        mask=row_ok[:, None] & (r_dims[None, :] < RANK), other=0.0)
        q_pe = tl.load(q_ptr + q_row[:, None] + RANK + p_dims[None, :],
                       mask=row_ok[:, None] & (p_dims[None, :] < ROPE), other=0.0)

        m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
        # keys up to the tile's last query position: causality bounds the loop
        last_pos = tl.minimum(seq_len - query_len + (tile * BLOCK_M + BLOCK_M - 1) // NUM_HEADS,
                              seq_len - 1)
        table = block_tables_ptr + seq * stride_table
        for start in range(0, last_pos + 1, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos <= last_pos
            block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
            base = block.to(tl.int64) * stride_block + (k_pos % BLOCK_SIZE) * stride_slot
            c = tl.load(kv_ptr + base[:, None] + r_dims[None, :],
                        mask=k_ok[:, None] & (r_dims[None, :] < RANK), other=0.0)
            k_pe = tl.load(kv_ptr + base[:, None] + RANK + p_dims[None, :],
                           mask=k_ok[:, None] & (p_dims[None, :] < ROPE), other=0.0)
            # the key is [c, k_pe]: its score is the sum of the two parts' dot products
            s = (tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
                 + tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)) * scale
            allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # ... and its value is c, the latent itself
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        o_row = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
        tl.store(out_ptr + o_row[:, None] + r_dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (r_dims[None, :] < RANK))


def mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int,
                  scale: float, max_query_len: int | None = None) -> torch.Tensor:
    """The Triton kernel: q [num_tokens, H, R + r], pool [num_blocks, block_size, R + r] -> [num_tokens, H, R]."""
    num_tokens, num_heads, width = q.shape
    block_size = kv_cache.shape[1]
    assert kv_cache.shape[2] == width and kv_cache.stride(-1) == 1 and q.stride(-1) == 1, \
        "q and the pool must share the row width R + r, contiguous in its last dimension"
    assert 0 < kv_lora_rank < width, "kv_lora_rank must be less than the row width (R + r, r > 0)"
    assert q.dtype == kv_cache.dtype, "q and the pool must share a dtype (tl.dot needs it)"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size: a power of two >= 8"
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    rows = max_query_len * num_heads
    block_m = min(64, max(MIN_DOT, triton.next_power_of_2(rows)))
    out = q.new_empty(num_tokens, num_heads, kv_lora_rank)
    grid = (seq_lens.shape[0], triton.cdiv(rows, block_m))
    rope = width - kv_lora_rank
    _mla_kernel[grid](
        out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, RANK=kv_lora_rank, ROPE=rope,
        RANK_PAD=max(MIN_DOT, triton.next_power_of_2(kv_lora_rank)),
        ROPE_PAD=max(MIN_DOT, triton.next_power_of_2(rope)),
        BLOCK_SIZE=block_size, BLOCK_N=max(MIN_DOT, min(block_size, 64)),
        BLOCK_M=block_m, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
