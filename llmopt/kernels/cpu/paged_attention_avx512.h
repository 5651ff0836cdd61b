// The AVX-512 path of paged_attention.cpp for decode items, with their state in registers (prompt
// items: paged_attention_prompt.h). Same online softmax, another order of sums.
//
// 1. Decode items.
// A decode step's item is one sequence's one new token against one kv head: G query rows (the
// heads sharing that kv head) over every cached key. The general loop keeps each row's output
// accumulator in memory and walks the rows in the outer loop, so every key's value row is
// converted and re-read per query row, and every update of the accumulator waits on the store
// before it (its cost per key: benchmarks/README.md, "Measurements behind the code's choices").
// Here the R x D/16 accumulators and the R query rows live in zmm registers, each key row is
// loaded once for all R rows, and the online softmax runs per 16 keys of a block (scores, their
// max, one rescale, exponentials, then the value rows), the scores of 16 keys summed into one
// vector without a horizontal sum per key.
#pragma once

#include <limits>
#include <utility>

#include "common.h"

#if defined(__AVX512F__)
#define LLMOPT_ATTN_AVX512 1

namespace llmopt::attn {

// D / 16 vectors of a pool row in float32. bfloat16: each 32 numbers are one load, their even
// lanes moved up 16 bits and their odd lanes masked, so vector 2j holds elements 32j + 2i and
// vector 2j + 1 elements 32j + 2i + 1 (the query rows and the accumulators take the same order;
// a dot product does not care, and the output is put back in order once per item): two
// instructions per 32 numbers instead of a widening shuffle and a shift per 16.
template <int NV, bool BF16>
inline void load_row(const void* src, __m512* dst) {
  for (int v = 0; v < NV; ++v) {
    if constexpr (BF16) {
      if (v % 2) continue;
      const __m512i w = _mm512_loadu_si512(static_cast<const __m512i*>(src) + v / 2);
      dst[v] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      dst[v + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u))));
    } else {
      dst[v] = _mm512_loadu_ps(static_cast<const float*>(src) + 16 * v);
    }
  }
}

// One step of a transpose-and-add: lanes whose bit H is clear get x[l] + x[l ^ H], the others
// y[l] + y[l ^ H]. Four steps turn the 16 per-lane partial dot products of keys 0..15 into one
// vector with key i's score in lane i (15 steps for 16 keys, where a horizontal sum per key
// took about 10 dependent instructions).
template <int H>
inline __m512 fold(__m512 x, __m512 y) {
  constexpr __mmask16 m = H == 1 ? 0xAAAA : H == 2 ? 0xCCCC : H == 4 ? 0xF0F0 : 0xFF00;
  const __m512 a = _mm512_mask_blend_ps(m, x, y), b = _mm512_mask_blend_ps(m, y, x);
  if constexpr (H == 1) return _mm512_add_ps(a, _mm512_permute_ps(b, 0xB1));
  if constexpr (H == 2) return _mm512_add_ps(a, _mm512_permute_ps(b, 0x4E));
  if constexpr (H == 4) return _mm512_add_ps(a, _mm512_shuffle_f32x4(b, b, 0xB1));
  return _mm512_add_ps(a, _mm512_shuffle_f32x4(b, b, 0x4E));
}

// Rows q [R, D] (float32) over keys k0..k1 of one sequence and kv head: running max m, sum l and
// unnormalized output acc [R, D], written out for the caller's epilogue (as the general loop
// leaves them). `block_at(b)` is the byte offset in the pools of the sequence's block b's first
// key row for this head, the next keys `key_stride` bytes apart. The keys go 16 at a time (fewer
// at a block's or the slice's ends): the 16 scores of a row come out in one vector (fold above),
// then its max, one rescale, the exponentials and their sum stay in registers.
template <int R, int NV, bool BF16, typename BlockAt>
void decode_item(const float* q, const char* kbase, const char* vbase, int64_t k0, int64_t k1, int64_t BS,
                 float scale, BlockAt block_at, size_t key_stride, float* m, float* l, float* acc) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512 qv[R][NV], av[R][NV], vsum[R];
  float mx_run[R];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      qv[r][v] = _mm512_loadu_ps(q + r * NV * 16 + 16 * v);
      av[r][v] = _mm512_setzero_ps();
    }
    if constexpr (BF16)   // the pool rows' order: even elements of each 32, then odd
      for (int v = 0; v < NV; v += 2) {
        const __m512 a = qv[r][v], b = qv[r][v + 1];
        qv[r][v] = _mm512_permutex2var_ps(a, even, b);
        qv[r][v + 1] = _mm512_permutex2var_ps(a, odd, b);
      }
    mx_run[r] = -std::numeric_limits<float>::infinity();
    vsum[r] = _mm512_setzero_ps();
  }
  // the rows of keys not yet read, asked for LEAD keys ahead: one head's rows are 1 / Hkv of each
  // block's bytes, scattered, which the hardware prefetcher does not follow (the cost without the
  // asks: benchmarks/README.md, "Measurements behind the code's choices"). Two rows at most per key
  // read, so the asks are spread among the loads rather than queued in front of them at each
  // block's start.
  constexpr int64_t ROW_BYTES = NV * 16 * (BF16 ? 2 : 4), LEAD = 32;  // keys (16 and 64 were slower)
  int64_t pf = std::min((k0 / BS + 1) * BS, k0 + 16), pf_blk = pf / BS, pf_off = pf % BS;  // past the first keys
  size_t pf_at = pf < k1 ? block_at(pf_blk) : 0;
  auto prefetch_to = [&](int64_t until) {   // ask for keys pf .. until (two at most)
    for (int k = 0; k < 2 && pf < std::min(until, k1); ++k, ++pf) {
      const size_t at = pf_at + pf_off * key_stride;
      for (int64_t c = 0; c < ROW_BYTES; c += 64) {
        _mm_prefetch(kbase + at + c, _MM_HINT_T0);
        _mm_prefetch(vbase + at + c, _MM_HINT_T0);
      }
      if (++pf_off == BS && pf + 1 < k1) pf_at = block_at(++pf_blk), pf_off = 0;
    }
  };
  alignas(64) float e[R][16];
  for (int64_t p0 = k0; p0 < k1;) {
    const int64_t blk = p0 / BS, p1 = std::min(k1, (blk + 1) * BS);
    const int64_t n = std::min<int64_t>(16, p1 - p0);   // keys p0 .. p0 + n, one block's
    const char* krow = kbase + block_at(blk) + size_t(p0 - blk * BS) * key_stride;
    const char* vrow = vbase + (krow - kbase);
    auto dots = [&](int i, __m512* out) {   // per-lane partial dot products of key i, or 0 past n
      if (i >= n) {
        for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
        return;
      }
      __m512 kv[NV];
      load_row<NV, BF16>(krow + i * key_stride, kv);
      for (int r = 0; r < R; ++r) {
        __m512 d = _mm512_mul_ps(qv[r][0], kv[0]);
        for (int v = 1; v < NV; ++v) d = _mm512_fmadd_ps(qv[r][v], kv[v], d);
        out[r] = d;
      }
    };
    __m512 s[R], d8[R][2];
    for (int g = 0; g < 2; ++g) {
      __m512 c4[R][2];
      for (int h = 0; h < 2; ++h) {
        __m512 b2[R][2];
        for (int j = 0; j < 2; ++j) {
          __m512 x[R], y[R];
          const int i = g * 8 + h * 4 + j * 2;
          dots(i, x);
          dots(i + 1, y);
          for (int r = 0; r < R; ++r) b2[r][j] = fold<1>(x[r], y[r]);
        }
        for (int r = 0; r < R; ++r) c4[r][h] = fold<2>(b2[r][0], b2[r][1]);
      }
      for (int r = 0; r < R; ++r) d8[r][g] = fold<4>(c4[r][0], c4[r][1]);
    }
    const __mmask16 valid = __mmask16((1u << n) - 1);
    for (int r = 0; r < R; ++r) {
      s[r] = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                fold<8>(d8[r][0], d8[r][1]), _mm512_set1_ps(scale));
      const float mx = std::max(mx_run[r], _mm512_reduce_max_ps(s[r]));
      const float corr = std::exp(mx_run[r] - mx);  // 0 on the first keys (m = -inf)
      if (corr != 1.0f) {
        const __m512 c = _mm512_set1_ps(corr);
        vsum[r] = _mm512_mul_ps(vsum[r], c);
        for (int v = 0; v < NV; ++v) av[r][v] = _mm512_mul_ps(av[r][v], c);
      }
      const __m512 ex = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s[r], _mm512_set1_ps(mx))));
      vsum[r] = _mm512_add_ps(vsum[r], ex);
      _mm512_store_ps(e[r], ex);
      mx_run[r] = mx;
    }
    for (int64_t i = 0; i < n; ++i) {
      __m512 vv[NV];
      load_row<NV, BF16>(vrow + i * key_stride, vv);
      prefetch_to(p0 + i + LEAD);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(e[r][i]);
        for (int v = 0; v < NV; ++v) av[r][v] = _mm512_fmadd_ps(w, vv[v], av[r][v]);
      }
    }
    p0 += n;
  }
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int r = 0; r < R; ++r) {
    m[r] = mx_run[r];
    l[r] = _mm512_reduce_add_ps(vsum[r]);
    if constexpr (BF16)   // back to the elements' order
      for (int v = 0; v < NV; v += 2) {
        const __m512 a = av[r][v], b = av[r][v + 1];
        av[r][v] = _mm512_permutex2var_ps(a, lo, b);
        av[r][v + 1] = _mm512_permutex2var_ps(a, hi, b);
      }
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
