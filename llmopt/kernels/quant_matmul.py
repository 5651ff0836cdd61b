"""W4A16: a matmul whose weights are 4-bit integers, unpacked on the fly, with 16/32-bit inputs.

A group-quantized weight W [K = in_features, N = out_features] is stored as integers q,
one scale and one zero point per group of `group_size` input rows and per output column:

    W[k, n] = scale[g(k), n] * (q[k, n] - zero[g(k), n])      g(k) = g_idx[k]  (or k // group_size)

Eight 4-bit integers fill one int32 word. The two layouts in use on the Hugging Face hub
differ only in which direction they pack and in what order:

- GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq", v1): `qweight` int32 [K/8, N],
  packed along the input dimension: word (i, n) holds rows 8i..8i+7 of column n, row
  8i + j in bits 4j..4j+3. `qzeros` int32 [K/G, N/8] packs zeros along the output
  dimension the same way, and stores zero - 1 (readers add the 1 back). `scales` fp16
  [K/G, N]. `g_idx` int32 [K] names each input row's group: k // G normally, a
  permutation of that with act-order (GPTQ quantizes columns in order of decreasing
  Hessian diagonal, and each group is a set of columns in *that* order). Other bit widths
  use the same rule as one little-endian bit stream: value j sits at bits j*bits.. of the
  column's words, so 3-bit values straddle word boundaries.
- AWQ (AutoAWQ, version "gemm"): `qweight` int32 [K, N/8], packed along the output
  dimension, with the interleaved nibble order [0, 2, 4, 6, 1, 3, 5, 7]: nibble i of word
  (k, m) holds column 8m + order[i] (it suits the fast dequantization trick of AWQ's CUDA
  kernel). `qzeros` int32 [K/G, N/8] in the same order, with no offset; `scales` [K/G, N];
  no g_idx, groups are k // G.

`unpack` and the two `*_dequantize` functions say this in torch; `w4a16_matmul_ref` is
dequantize-then-matmul. The Triton kernel `w4a16_matmul` computes the same thing tile by
tile without ever writing W out: each program loads a [BLOCK_K, BLOCK_N] tile of packed
words, shifts and masks the nibbles out, looks up each row's group scale and zero, and
feeds the dequantized tile to `tl.dot`. Memory traffic for the weights is a quarter of
fp16's, which is what makes decoding (memory-bound) faster on a GPU. At decode batch sizes the
inputs are split among programs too (split-K), so that a one-row product keeps the GPU busy.
The engine keeps this kernel for the lesson and for what tinygemm cannot run
(llmopt/layers/quant/cuda_int4.py); the benchmarks time the two side by side.
"""

from __future__ import annotations

import torch

from llmopt.kernels import HAS_TRITON
from llmopt.kernels.split_k import k_per_split, reduce_partials, split_k

# nibble i of an AWQ word holds column AWQ_PACK_ORDER[i] of its 8 columns
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# ... so column c of 8 sits in nibble AWQ_NIBBLE_OF_COLUMN[c] = c // 2 + (c % 2) * 4
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
LAYOUTS = ("gptq", "awq")


# -- the layouts in torch ------------------------------------------------------------------------
def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> integers in [0, 2^bits), as one little-endian bit stream along `dim`
    (value j at bits j*bits .. j*bits + bits - 1). The size along `dim` grows by 32 / bits."""
    packed = packed.movedim(dim, -1).to(torch.int32)
    if 32 % bits == 0:  # 2, 4, 8 bits: whole values per word
        shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
        values = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)
    else:               # 3 bits: read the stream bit by bit
        bit = torch.arange(32, device=packed.device, dtype=torch.int32)
        stream = ((packed.unsqueeze(-1) >> bit) & 1).flatten(-2)
        stream = stream.view(*stream.shape[:-1], -1, bits)
        values = (stream << torch.arange(bits, device=packed.device, dtype=torch.int32)).sum(-1)
    return values.movedim(-1, dim).to(torch.int32)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ [rows, N/8] words -> [rows, N] integers, undoing the interleaved nibble order."""
    nibbles = unpack(packed, 4, dim=1)  # nibble order within each word of 8
    rows, n = nibbles.shape
    index = torch.tensor(AWQ_NIBBLE_OF_COLUMN, device=packed.device)
    return nibbles.view(rows, n // 8, 8)[:, :, index].reshape(rows, n)


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, bits: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GPTQ v1 tensors -> W [K, N]."""
    q = unpack(qweight, bits, dim=0)                # [K, N]
    zeros = unpack(qzeros, bits, dim=1) + 1         # [groups, N]; v1 stores zero - 1
    g = g_idx.long()
    return ((q - zeros[g]).float() * scales[g].float()).to(dtype)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """AWQ GEMM tensors -> W [K, N]."""
    q = awq_unpack(qweight)                         # [K, N]
    zeros = awq_unpack(qzeros)                      # [groups, N]
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return ((q - zeros[g]).float() * scales[g].float()).to(dtype)


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                     scales: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
                     layout: str = "gptq", bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(W) [K, N] (+ bias), in x's dtype: the kernel's reference."""
    if layout == "gptq":
        if g_idx is None:
            g_idx = torch.arange(qweight.shape[0] * 8, device=x.device) // group_size
        w = gptq_dequantize(qweight, qzeros, scales, g_idx, 4, x.dtype)
    else:
        w = awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)
    out = x @ w
    return out + bias if bias is not None else out


# -- the Triton kernel ------------------------------------------------------------------------------
if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _w4a16_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, gidx_ptr, bias_ptr, out_ptr,
                      M, N, K, group_size,
                      stride_xm, stride_xk, stride_qw0, stride_qw1, stride_qz0, stride_qz1,
                      stride_s0, stride_s1, stride_om, stride_on, k_split,
                      AWQ: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      IEEE: tl.constexpr):
        # program (m tile, n tile, slice of K): split into several slices, each writes its float32
        # partial sum to out[slice] ([slices, M, N]); llmopt/kernels/split_k.py adds them up
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        if AWQ:
            # column n sits in word n // 8, nibble (n % 8) // 2 + (n % 2) * 4
            shift_n = ((offs_n % 8) // 2 + (offs_n % 2) * 4) * 4
            zero_offset = 0
        else:
            shift_n = (offs_n % 8) * 4  # qzeros packs columns in plain order
            zero_offset = 1             # v1 stores zero - 1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * k_split, tl.minimum(K, (pid_k + 1) * k_split), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_k[:, None] & mask_n[None, :]
            if AWQ:   # qweight [K, N/8]: word (k, n // 8)
                words = tl.load(qw_ptr + offs_k[:, None] * stride_qw0 + (offs_n // 8)[None, :] * stride_qw1,
                                mask=mask_w, other=0)
                q = (words >> shift_n[None, :]) & 0xF
            else:     # qweight [K/8, N]: word (k // 8, n), row k in nibble k % 8
                words = tl.load(qw_ptr + (offs_k // 8)[:, None] * stride_qw0 + offs_n[None, :] * stride_qw1,
                                mask=mask_w, other=0)
                q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
            if HAS_GIDX:  # act-order: each row names its group
                g = tl.load(gidx_ptr + offs_k, mask=mask_k, other=0)
            else:
                g = offs_k // group_size
            scale = tl.load(s_ptr + g[:, None] * stride_s0 + offs_n[None, :] * stride_s1,
                            mask=mask_w, other=0.0)
            zwords = tl.load(qz_ptr + g[:, None] * stride_qz0 + (offs_n // 8)[None, :] * stride_qz1,
                             mask=mask_w, other=0)
            zero = ((zwords >> shift_n[None, :]) & 0xF) + zero_offset
            w = ((q - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
            if IEEE:  # fp32 inputs: full-precision products, not TF32
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        out_ptr += pid_k * M * N  # (0 without a split)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, group_size: int, layout: str = "gptq",
                 bias: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
    """x [M, K] @ W (+ bias) with W packed in the GPTQ or AWQ 4-bit layout; out [M, N] in x's dtype.

    `g_idx` (GPTQ only) gives each input row's group; None means k // group_size. `split`: slices
    of K (llmopt/kernels/split_k.py; None: as many as a decode-sized M needs to fill the GPU).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    M, K = x.shape
    N = qweight.shape[1] if layout == "gptq" else qweight.shape[1] * 8
    # tl.dot needs every dimension >= 16; small M (decode) is masked inside a 16-row tile
    BLOCK_M = 16 if M <= 16 else 32 if M <= 32 else 64
    BLOCK_N, BLOCK_K = 64, 32
    split = split_k(M, N, K, BLOCK_N, BLOCK_K, x.device) if split is None else split
    per_split = k_per_split(K, split, BLOCK_K)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    has_gidx = layout == "gptq" and g_idx is not None
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), split)
    _w4a16_kernel[grid](
        x, qweight, qzeros, scales, g_idx if has_gidx else qweight, bias if bias is not None else x, out,
        M, N, K, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), qzeros.stride(0), qzeros.stride(1),
        scales.stride(0), scales.stride(1), out.stride(-2), out.stride(-1), per_split,
        AWQ=layout == "awq", HAS_GIDX=has_gidx, HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return out if split == 1 else reduce_partials(out, x.dtype, bias=bias)
