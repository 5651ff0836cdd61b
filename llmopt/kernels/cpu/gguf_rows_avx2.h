// The AVX2 row kernels of gguf_matmul.cpp's int8 path, where the CPU has no AVX512_VNNI and a row
// holds an even number of blocks (else gguf_rows.h's dot_row_int8 takes them, one at a time).
//
// Why: at one row of x a 1B model's weights stream from memory, and the one-block-a-time loop
// spends about 17 instructions a block (its nibbles unpacked into a 128-bit half each, then q - 8 and
// two sign moves so that maddubs may take signed weights, a scalar fp16 scale converted and
// broadcast), more cycles than DRAM needs to deliver 18 bytes. Here:
// - a row's blocks lie back to back, 16 bytes each, so one 32-byte load holds blocks b and b + 1:
//   its low nibbles are weights 0..15 of both, its high nibbles weights 16..31. x is laid out the
//   same way once per call (`make_pairs`: lo = x_b[0..15] | x_b+1[0..15], hi = x_b[16..31] |
//   x_b+1[16..31]), so a pair costs a load, a shift and two ands to unpack;
// - a nibble is 0..15, already unsigned as maddubs wants it; Q4_0's "- 8" moves onto x,
//   dot(q - 8, x) = dot(q, x) - 8 sum(x), the second term laid out per int32 lane once per call (c);
// - lanes 0..3 of a pair's sums belong to block b, 4..7 to b + 1, so eight blocks' scales
//   d_w * d_x come from one fp16 conversion and one multiply, and a permute places each pair's.
// - each row asks for its bytes PREFETCH_BYTES ahead of its loads (common.h says why).
// Q8_0 takes the same scales and prefetch, a block a load. The integer block sums are the same
// exact integers as the one-block loop's; only the order of the float32 additions differs.
#pragma once

#include <cstdint>

#include "common.h"
#include "gguf_rows.h"

namespace llmopt {
namespace avx2rows {

#ifdef LLMOPT_AVX2

// x's quantized row as the pairs of blocks meet it: lo / hi [K / 64][32] int8, and for Q4_0
// c [K / 64][8] int32, -8 times the sum of the x values each lane of a pair's product meets.
inline void make_pairs(const int8_t* q, int64_t nb, int8_t* lo_hi, int32_t* c) {
  const __m256i eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < nb / 2; ++p) {
    const int8_t* b0 = q + 2 * p * QK;
    const int8_t* b1 = b0 + QK;
    const __m256i lo = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1)),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0)));
    const __m256i hi = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + 16)),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo_hi + p * 64), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo_hi + p * 64 + 32), hi);
    if (c) {
      const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(eight, lo), _mm256_maddubs_epi16(eight, hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + p * 8),
                          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(sums, ones)));
    }
  }
}

// The scales of step j of a group of eight blocks, each on its block's lanes: Q8_0 steps one block
// (all eight lanes), Q4 a pair (four lanes each).
template <int64_t TYPE>
static inline __m256 step_scales(__m256 s8, int j) {
  if constexpr (TYPE == Q8_0) return _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(j));
  else return _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j,
                                                             2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1));
}

// One weight row (nb blocks, nb even) against MT rows of x, each a QuantizedRow (for Q4 with the
// `pairs`, and for Q4_0 the `pairs_c`, make_pairs wrote): out[m] = sum_b d_w d_x dot_b (+ m_w s_x).
// Q8_0 steps one block at a time: a block is a whole 32-byte load, so it takes the one-block
// loop's sign moves (maddubs wants one side unsigned); its scales and prefetch are the Q4 pairs'.
template <int64_t TYPE, int MT>
static void dot_row(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, int64_t nb,
                    const QuantizedRow* xs, float* out) {
  constexpr int STEP = TYPE == Q8_0 ? 1 : 2;           // blocks a load
  constexpr int64_t BYTES = TYPE == Q8_0 ? 32 : 16;    // a block's weight bytes
  constexpr int A = MT == 1 ? 2 : 1;  // accumulators per row of x: one FMA chain alone waits 4 cycles
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MT][A], mins[MT];
  for (int m = 0; m < MT; ++m) {
    mins[m] = _mm256_setzero_ps();
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  }
  // one load (block b, or blocks b and b + 1) into every row's accumulator a, with its scales s[m]
  auto step = [&](int64_t b, const __m256* s, int a) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * BYTES));
    if constexpr (TYPE == Q8_0) {
      const __m256i wabs = _mm256_sign_epi8(v, v);
      for (int m = 0; m < MT; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[m].q + b * QK));
        acc[m][a] = _mm256_fmadd_ps(s[m], dot_u8_s8(wabs, _mm256_sign_epi8(x, v)), acc[m][a]);
      }
    } else {
      const __m256i wlo = _mm256_and_si256(v, low4), whi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int m = 0; m < MT; ++m) {
        const int8_t* x = xs[m].pairs + b * 32;
        const __m256i sums = _mm256_add_epi16(
            _mm256_maddubs_epi16(wlo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
            _mm256_maddubs_epi16(whi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
        __m256i dots = _mm256_madd_epi16(sums, ones);
        if constexpr (TYPE == Q4_0)
          dots = _mm256_add_epi32(dots, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[m].pairs_c + b * 4)));
        acc[m][a] = _mm256_fmadd_ps(s[m], _mm256_cvtepi32_ps(dots), acc[m][a]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    for (int64_t line = 0; line < 8 * BYTES; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * BYTES + PREFETCH_BYTES + line), _MM_HINT_T0);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b)));
    __m256 s8[MT];
    for (int m = 0; m < MT; ++m) {
      s8[m] = _mm256_mul_ps(dw, _mm256_loadu_ps(xs[m].d + b));
      if constexpr (TYPE == Q4_1) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + b)));
        mins[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs[m].s + b), mins[m]);
      }
    }
    for (int j = 0; j < 8 / STEP; ++j) {
      __m256 s[MT];
      for (int m = 0; m < MT; ++m) s[m] = step_scales<TYPE>(s8[m], j);
      step(b + STEP * j, s, j % A);
    }
  }
  float tail[MT] = {};
  for (; b < nb; b += STEP) {  // the last blocks short of a group of eight, their scales one by one
    const float d0 = fp16_to_float(wd[b]), d1 = fp16_to_float(wd[b + STEP - 1]);
    __m256 s[MT];
    for (int m = 0; m < MT; ++m) {
      s[m] = _mm256_set_m128(_mm_set1_ps(d1 * xs[m].d[b + STEP - 1]), _mm_set1_ps(d0 * xs[m].d[b]));
      if constexpr (TYPE == Q4_1)
        tail[m] += fp16_to_float(wm[b]) * xs[m].s[b] + fp16_to_float(wm[b + 1]) * xs[m].s[b + 1];
    }
    step(b, s, 0);
  }
  for (int m = 0; m < MT; ++m) {
    __m256 total = acc[m][0];
    if constexpr (A == 2) total = _mm256_add_ps(total, acc[m][A - 1]);
    out[m] = hsum8(total) + (TYPE == Q4_1 ? hsum8(mins[m]) + tail[m] : 0.0f);
  }
}

#endif

}  // namespace avx2rows
}  // namespace llmopt
