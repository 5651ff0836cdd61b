"""PagedAttention: attention that reads keys and values from a pool of fixed-size blocks.

A contiguous KV cache reserves room for the longest possible sequence; a paged one
(vLLM's idea) cuts each layer's cache into blocks of `block_size` tokens and hands them
out on demand. `k_cache` and `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`; sequence i owns the blocks listed in row i of `block_tables` (int32, padded
with 0 past its last block), so the token at position p lives in block
`block_tables[i, p // block_size]`, slot `p % block_size`. The pool's `write_kv`
(llmopt/worker/kv_cache.py) stores a step's new keys and values first, so attention reads
every key, its own included, from the pool.

The batch is flat, as in vLLM: `q` is `[num_tokens, num_heads, head_dim]`, the new tokens
of every sequence one after another; `query_start_loc` (int32, num_seqs + 1) marks where
each sequence's queries start, and `seq_lens` (int32) is each sequence's length after this
step. Query j of a sequence with n new tokens sits at position `seq_len - n + j` and sees
keys at positions <= its own (and > its own minus `sliding_window`, when one is set).
With GQA, query head h reads kv head `h // (num_heads // num_kv_heads)`.

`paged_attention_ref` (paged_attention_ref.py) says all this in plain torch. The two Triton kernels compute the
same thing tile by tile with an online softmax (FlashAttention's running max and sum, in
fp32), gathering each tile of keys through the block table: `paged_attention_decode` for
one new token per sequence, `paged_attention_prefill` for any mix of prompts, prompt
chunks and decodes. `paged_attention` picks one.

FP8 caches. The pool may hold float8 (e4m3 or e5m2, one byte per number) instead of the
model's dtype, with one scale per tensor for keys and one for values (per layer, kept by
the caller): `write_kv` stores fp8(clamp(k / k_scale)), and attention reads k ~ fp8 * k_scale.
The kernels load the fp8 tile and widen it to the queries' dtype, which is exact (every
e4m3 and e5m2 value is a float16 and a bfloat16 value), then fold the scales into the
arithmetic instead of into every element: q . (k * k_scale) = (q . k) * k_scale, and
sum p (v * v_scale) = (sum p v) * v_scale.
"""

from __future__ import annotations

import torch

from llmopt.fp8.format import native_fp8_supported
from llmopt.kernels import HAS_TRITON
from llmopt.kernels.paged_attention_ref import paged_attention_ref  # noqa: F401  (the meaning, beside its kernels)

# The kernels hold a head in registers as one power-of-two block, and tl.dot needs >= 16.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
# tl.dot needs every dimension >= 16 when compiled for a GPU (the interpreter is laxer),
# so query rows and key tiles are padded or grouped up to this.
MIN_DOT = 16
# "No sliding window" is a window longer than any sequence: one code path for both.
NO_WINDOW = 1 << 30
# Keys a decode program takes per step of its loop, whatever the block size (a tile may span
# several blocks: each key looks up its own). At 16 keys (one block) a program over a long
# context makes 128 small trips to memory for 2,048 keys, each waiting on the last; larger tiles
# put more bytes in flight per trip, which is what lets an fp8 pool's half-size tiles read in
# about half the time. benchmarks/gpu_kernels.py times 16 to 128 on the GPU beside this default.
DECODE_KEYS_PER_TILE = 64
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_DTYPES


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _e4m3_from_bits(x):
        """float8_e4m3fn bytes (uint8) -> fp32, by integer arithmetic on the bit fields.

        For GPUs before compute capability 8.9, where Triton has no e4m3 type: there FP8 is
        a storage format only, and widening it is a few shifts (as vLLM's kernels do there).
        Normal numbers move their exponent from bias 7 to fp32's bias 127 and their 3
        mantissa bits to the top of fp32's 23; subnormals (exponent 0) are m * 2^-9.
        The NaN pattern never occurs: writes clamp to +-448.
        """
        b = x.to(tl.uint32)
        exp = (b >> 3) & 0xF
        man = b & 0x7
        sign = (b & 0x80) << 24
        normal = (sign | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        sub = man.to(tl.float32) * 0.001953125
        sub = tl.where(sign != 0, -sub, sub)
        return tl.where(exp == 0, sub, normal)

    @triton.jit
    def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, k_pos, k_ok, kv_head, dims,
                      stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr,
                      E4M3_BITS: tl.constexpr):
        """Gather keys and values at positions k_pos of one sequence through its block table.

        Each position looks up its own block, so one tile may span several small blocks or
        part of a large one. Masked-off positions read nothing and come back as zeros.
        """
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        # int64 so that block * stride cannot overflow in a pool of more than 2**31 elements.
        row = block.to(tl.int64) * stride_block + (k_pos % BLOCK_SIZE) * stride_slot
        offsets = row[:, None] + kv_head * stride_head + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=k_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=k_ok[:, None], other=0.0)
        if E4M3_BITS:  # the pool was passed as bytes: decode them here
            k = _e4m3_from_bits(k)
            v = _e4m3_from_bits(v)
        return k, v

    @triton.jit
    def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, scale,
                             DOT_PRECISION: tl.constexpr):
        """Fold one tile of keys into the running max m_i, sum l_i and output acc (all fp32)."""
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rescale what was summed under the old max; a masked key contributes exp(-inf) = 0.
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
            out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
            scale, k_scale, v_scale, window,
            stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
            stride_block, stride_slot, stride_head, stride_table,
            QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
            E4M3_BITS: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + seq)
        q_pos = seq_len - 1

        # The query heads sharing this kv head are the rows of one matrix, so each key tile
        # is loaded once for all of them; rows past QUERIES_PER_KV are padding for tl.dot.
        rows = tl.arange(0, GROUP_PAD)
        row_ok = rows < QUERIES_PER_KV
        heads = kv_head * QUERIES_PER_KV + rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                    mask=row_ok[:, None], other=0.0)

        # A finite start for the max keeps exp(m_i - m_new) a number even before any key.
        m_i = tl.full([GROUP_PAD], -1e30, dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

        # k_scale multiplies every score, v_scale every output: folded in once, not per element.
        qk_scale = scale * k_scale
        # Tiles wholly before the sliding window are skipped, not just masked.
        lo = tl.maximum(q_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        block_table_ptr = block_tables_ptr + seq * stride_table
        for start in range(lo, seq_len, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < seq_len
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, k_pos, k_ok,
                                 kv_head, dims, stride_block, stride_slot, stride_head,
                                 BLOCK_SIZE, E4M3_BITS)
            # widen an fp8 tile to the queries' dtype (exact); a no-op for a full-precision pool
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            allowed = (k_ok & (k_pos > q_pos - window))[None, :]
            m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale,
                                                 DOT_PRECISION)

        out = acc * (v_scale / l_i)[:, None]
        tl.store(out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _paged_prefill_kernel(
            out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
            seq_lens_ptr, tree_bits_ptr, scale, k_scale, v_scale, window,
            stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
            stride_block, stride_slot, stride_head, stride_table,
            QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
            E4M3_BITS: tl.constexpr, HAS_TREE: tl.constexpr):
        q_tile = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // QUERIES_PER_KV

        # The grid is sized for the longest query; shorter sequences have idle tiles.
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_tile * BLOCK_M >= query_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - query_len    # tokens cached before this step's chunk

        rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < query_len
        q_pos = context_len + rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head
                    + dims[None, :], mask=row_ok[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        qk_scale = scale * k_scale
        if HAS_TREE:  # a draft tree: per query row, which of the sequence's last 64 keys it sees (-1: all)
            bits = tl.load(tree_bits_ptr + q_start + rows, mask=row_ok, other=-1)

        # This tile's queries see keys from its first query's window start up to its last
        # query's own position: causality bounds the loop, not only the mask.
        first_pos = context_len + q_tile * BLOCK_M
        end_pos = tl.minimum(first_pos + BLOCK_M, seq_len)
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        block_table_ptr = block_tables_ptr + seq * stride_table
        for start in range(lo, end_pos, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_ok = k_pos < end_pos
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, k_pos, k_ok,
                                 kv_head, dims, stride_block, stride_slot, stride_head,
                                 BLOCK_SIZE, E4M3_BITS)
            # widen an fp8 tile to the queries' dtype (exact); a no-op for a full-precision pool
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            allowed = ((k_pos[None, :] <= q_pos[:, None])
                       & (k_pos[None, :] > q_pos[:, None] - window) & k_ok[None, :])
            if HAS_TREE:  # the key at seq_len - 64 + j is seen only where bit j is set
                j = k_pos - (seq_len - 64)
                bit = (bits[:, None] >> tl.minimum(tl.maximum(j, 0), 63).to(tl.int64)[None, :]) & 1
                allowed &= (bits[:, None] == -1) | (j < 0)[None, :] | (bit != 0)
            m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale,
                                                 DOT_PRECISION)

        # Padding rows past query_len saw no key; keep their division finite, they are not stored.
        out = acc * (v_scale / tl.where(row_ok, l_i, 1.0))[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check_and_tile(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    sliding_window: int | None):
    """Shared checks; returns (queries_per_kv, keys per tile, window, dot precision)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "k_cache, v_cache differ"
    assert k_cache.stride(-1) == 1, "the cache's head_dim must be contiguous"
    assert head_dim in SUPPORTED_HEAD_DIMS, f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, f"block_size {block_size}: a power of two >= 8"
    assert q.shape[-1] == head_dim and q.shape[1] % num_kv_heads == 0, "q: [num_tokens, num_heads, head_dim]"
    assert v_cache.dtype == k_cache.dtype, "k_cache and v_cache must share a dtype"
    if q.dtype in FP8_DTYPES:
        raise TypeError(f"q must be float32, float16 or bfloat16, got {q.dtype}; only the cache may be fp8")
    if not is_fp8_cache(k_cache):  # (an fp8 pool is widened to q's dtype tile by tile in the kernel)
        assert q.dtype == k_cache.dtype, "q and the cache must share a dtype (tl.dot needs it)"
    assert sliding_window is None or sliding_window >= 1
    # One block per tile, or several small blocks together so a tile has >= 16 keys.
    block_n = max(block_size, MIN_DOT)
    window = NO_WINDOW if sliding_window is None else sliding_window
    # fp32 inputs would otherwise go through TF32 tensor cores on the GPU (10-bit mantissa).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    return q.shape[1] // num_kv_heads, block_n, window, precision


def _check_scales(k_scale, v_scale) -> tuple[float, float]:
    for name, s in (("k_scale", float(k_scale)), ("v_scale", float(v_scale))):
        if not (s > 0 and s != float("inf")):
            raise ValueError(f"{name} must be a positive finite number, got {s}")
    return float(k_scale), float(v_scale)


def triton_has_e4m3(device: torch.device) -> bool:
    """Triton knows e4m3 where FP8 is computed (CUDA from compute capability 8.9: Ada, Hopper; see
    llmopt.fp8.format.fp8_compute_supported), and in the interpreter. Elsewhere an FP8 pool is storage."""
    return device.type != "cuda" or native_fp8_supported(device)


def _kv_operands(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The pool as the kernel reads it, and whether it must decode e4m3 from raw bytes."""
    # asked for every fp8 pool, e5m2 too, so that a GPU without FP8 units says once that it stores FP8 only
    if is_fp8_cache(k_cache) and not triton_has_e4m3(k_cache.device) and k_cache.dtype == torch.float8_e4m3fn:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), True
    return k_cache, v_cache, False


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           keys_per_tile: int = DECODE_KEYS_PER_TILE) -> torch.Tensor:
    """One new token per sequence: q [num_seqs, num_heads, head_dim], its key already cached.

    One program per (sequence, kv head) walks the sequence's keys in order, `keys_per_tile` (a
    power of two; at least one block) at a time.
    """
    queries_per_kv, block_n, window, precision = _check_and_tile(q, k_cache, v_cache,
                                                                 sliding_window)
    assert keys_per_tile >= MIN_DOT and keys_per_tile & (keys_per_tile - 1) == 0, "keys_per_tile: a power of two >= 16"
    block_n = max(block_n, keys_per_tile)
    k_scale, v_scale = _check_scales(k_scale, v_scale)
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    k_pool, v_pool, e4m3_bits = _kv_operands(k_cache, v_cache)
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, q, k_pool, v_pool, block_tables, seq_lens, scale, k_scale, v_scale, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=k_cache.shape[3], BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        DOT_PRECISION=precision, E4M3_BITS=e4m3_bits)
    return out


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            sliding_window: int | None = None,
                            max_query_len: int | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Any batch of prompts, prompt chunks after cached context, and decodes, in one call.

    One program per (tile of BLOCK_M queries, sequence, query head). Pass max_query_len
    when it is known (the scheduler knows it) to spare a device-to-host sync. tree_bits
    ([num_tokens] int64): draft trees' masks, as `paged_attention_ref` reads them.
    """
    queries_per_kv, block_n, window, precision = _check_and_tile(q, k_cache, v_cache,
                                                                 sliding_window)
    k_scale, v_scale = _check_scales(k_scale, v_scale)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # Short chunks waste fewer padding rows in small tiles; long prompts reuse each
    # loaded key tile across more queries in big ones.
    block_m = min(64, max(MIN_DOT, triton.next_power_of_2(max_query_len)))
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads = seq_lens.shape[0], q.shape[1]
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    k_pool, v_pool, e4m3_bits = _kv_operands(k_cache, v_cache)
    has_tree = tree_bits is not None
    _paged_prefill_kernel[grid](
        out, q, k_pool, v_pool, block_tables, query_start_loc, seq_lens,
        tree_bits.contiguous() if has_tree else seq_lens, scale, k_scale, v_scale, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=k_cache.shape[3], BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=precision, E4M3_BITS=e4m3_bits, HAS_TREE=has_tree)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    max_query_len: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """The decode kernel when every sequence brings exactly one token, else the prefill one
    (which also verifies draft trees under `tree_bits`).

    Every sequence brings at least one token, so num_tokens == num_seqs means all are
    decodes: a test on shapes, with no sync on the device.
    """
    if tree_bits is not None:
        return paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                       sliding_window, max_query_len, k_scale, v_scale, tree_bits)
    if max_query_len == 1 or (max_query_len is None and q.shape[0] == seq_lens.shape[0]):
        return paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      sliding_window, k_scale, v_scale)
    return paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc,
                                   seq_lens, scale, sliding_window, max_query_len,
                                   k_scale, v_scale)
