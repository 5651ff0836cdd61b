// The AVX-512 path of paged_attention.cpp for decode items, with their state in registers (prompt
// items: paged_attention_prompt.h). Same online softmax, another order of sums.
//
// 1. Decode items.
// A decode step's item is one sequence's one new token against one kv head: G query rows (the
// heads sharing that kv head) over every cached key. The general loop keeps each row's output
// accumulator in memory and walks the rows in the outer loop, so every key's value row is
// converted and re-read per query row, and every update of the accumulator waits on the store
// before it (about 130 cycles a key for SmolLM2's 3 rows of 64). Here the R x D/16 accumulators
// and the R query rows live in zmm registers, each key row is loaded once for all R rows, and
// the online softmax runs per block of keys exactly as the general loop does it (scores, the
// block's max, one rescale, exponentials 16 at a time, then the value rows).
#pragma once

#include <limits>
#include <utility>

#include "common.h"

#if defined(__AVX512F__)
#define LLMOPT_ATTN_AVX512 1

namespace llmopt::attn {

// D / 16 vectors of a pool row in float32: float32 as it is, bfloat16 moved up 16 bits.
template <int NV, bool BF16>
inline void load_row(const void* src, __m512* dst) {
  for (int v = 0; v < NV; ++v) {
    if constexpr (BF16) {
      const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(src) + v);
      dst[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      dst[v] = _mm512_loadu_ps(static_cast<const float*>(src) + 16 * v);
    }
  }
}

// Rows q [R, D] (float32) over keys k0..k1 of one sequence and kv head: running max m, sum l and
// unnormalized output acc [R, D], written out for the caller's epilogue (as the general loop
// leaves them). `block_at(b)` is the byte offset in the pools of the sequence's block b's first
// key row for this head, the next keys `key_stride` bytes apart. (A per-key offset, p / BS and
// p % BS ten times a key with the prefetches: one 600-key call of SmolLM2's shape, 3 rows, took
// 55 us on one thread that way against 45 this way.)
template <int R, int NV, bool BF16, typename BlockAt>
void decode_item(const float* q, const char* kbase, const char* vbase, int64_t k0, int64_t k1, int64_t BS,
                 float scale, BlockAt block_at, size_t key_stride, float* m, float* l, float* acc) {
  __m512 qv[R][NV], av[R][NV];
  float mx_run[R], sum[R];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      qv[r][v] = _mm512_loadu_ps(q + r * NV * 16 + 16 * v);
      av[r][v] = _mm512_setzero_ps();
    }
    mx_run[r] = -std::numeric_limits<float>::infinity();
    sum[r] = 0.0f;
  }
  alignas(64) float s[R][64];
  for (int64_t p0 = k0; p0 < k1;) {
    const int64_t blk = p0 / BS, p1 = std::min(k1, (blk + 1) * BS), n = p1 - p0;  // keys of one block (<= 64)
    const size_t base = block_at(blk) + size_t(p0 - blk * BS) * key_stride;  // key p0's row
    // the next block's rows, asked for now: one head's rows are 1 / Hkv of each block's bytes,
    // scattered, which the hardware prefetcher does not follow (8 x 140 keys: 105 us a layer without)
    constexpr int64_t ROW_BYTES = NV * 16 * (BF16 ? 2 : 4);
    if (p1 < k1) {
      const size_t next = block_at(blk + 1);
      for (int64_t p = p1; p < std::min(k1, p1 + BS); ++p)
        for (int64_t b = 0; b < ROW_BYTES; b += 64) {
          _mm_prefetch(kbase + next + (p - p1) * key_stride + b, _MM_HINT_T0);
          _mm_prefetch(vbase + next + (p - p1) * key_stride + b, _MM_HINT_T0);
        }
    }
    for (int64_t p = p0; p < p1; ++p) {
      __m512 kv[NV];
      load_row<NV, BF16>(kbase + base + (p - p0) * key_stride, kv);
      for (int r = 0; r < R; ++r) {
        __m512 d = _mm512_mul_ps(qv[r][0], kv[0]);
        for (int v = 1; v < NV; ++v) d = _mm512_fmadd_ps(qv[r][v], kv[v], d);
        s[r][p - p0] = _mm512_reduce_add_ps(d) * scale;
      }
    }
    for (int r = 0; r < R; ++r) {
      float mx = mx_run[r];
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[r][i]);
      const float corr = std::exp(mx_run[r] - mx);  // 0 on the first keys (m = -inf)
      if (corr != 1.0f) {
        sum[r] *= corr;
        for (int v = 0; v < NV; ++v) av[r][v] = _mm512_mul_ps(av[r][v], _mm512_set1_ps(corr));
      }
      exp_shifted_add(s[r], n, mx, sum[r]);
      mx_run[r] = mx;
    }
    for (int64_t p = p0; p < p1; ++p) {
      __m512 vv[NV];
      load_row<NV, BF16>(vbase + base + (p - p0) * key_stride, vv);
      for (int r = 0; r < R; ++r) {
        const __m512 e = _mm512_set1_ps(s[r][p - p0]);
        for (int v = 0; v < NV; ++v) av[r][v] = _mm512_fmadd_ps(e, vv[v], av[r][v]);
      }
    }
    p0 = p1;
  }
  for (int r = 0; r < R; ++r) {
    m[r] = mx_run[r];
    l[r] = sum[r];
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * NV * 16 + 16 * v, av[r][v]);
  }
}

// The instantiation for R rows of D = 16 * NV, or false where there is none (the general loop runs).
template <bool BF16, typename BlockAt>
bool decode_item_any(int64_t rows, int64_t D, const float* q, const char* kbase, const char* vbase, int64_t k0,
                     int64_t k1, int64_t BS, float scale, BlockAt block_at, size_t key_stride, float* m, float* l,
                     float* acc) {
  if (BS > 64) return false;
#define LLMOPT_CASE(RR, NVV) \
  if (rows == RR && D == 16 * NVV) { \
    decode_item<RR, NVV, BF16>(q, kbase, vbase, k0, k1, BS, scale, block_at, key_stride, m, l, acc); \
    return true; \
  }
  LLMOPT_CASE(1, 4) LLMOPT_CASE(2, 4) LLMOPT_CASE(3, 4) LLMOPT_CASE(4, 4)
  LLMOPT_CASE(1, 8) LLMOPT_CASE(2, 8)
  LLMOPT_CASE(1, 2) LLMOPT_CASE(2, 2) LLMOPT_CASE(3, 2) LLMOPT_CASE(4, 2)
#undef LLMOPT_CASE
  return false;
}

}  // namespace llmopt::attn
#endif
