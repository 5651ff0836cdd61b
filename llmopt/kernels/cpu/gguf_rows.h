// The row kernels of gguf_matmul.cpp for CPUs without AVX512_VNNI: GGUF blocks times int8
// activations with AVX2 (maddubs + madd, 32 products per instruction pair, as llama.cpp's AVX2
// path), or in plain C++ where there is no AVX2; and the weights dequantized in registers times
// fp32 x (`dot_row_f32`, no rounding of x). gguf_vnni.h holds the AVX-512 tiles that replace the
// int8 ones where the CPU has them.
#pragma once

#include <cstdint>

#include "common.h"

namespace llmopt {

constexpr int QK = 32;
enum GGMLType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

// One row of x quantized per 32 values: q int8 [K], d and s (fp16-rounded floats) [K / 32].
struct QuantizedRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* c = nullptr;  // VNNI Q8_0 (signed codes): -bias * (sum of each 4 values of q)
  const int8_t* split = nullptr;     // VNNI Q4: q per four blocks, their values 0..15 then 16..31
  const int32_t* split_c = nullptr;  // VNNI Q4_0: -8 * (sum of the 8 values of split each lane meets)
  const int8_t* pairs = nullptr;     // AVX2 Q4: q laid out per two blocks (gguf_rows_avx2.h)
  const int32_t* pairs_c = nullptr;  // AVX2 Q4_0: -8 * (sum of the values of pairs each lane meets)
};

#ifdef LLMOPT_AVX2

// 16 bytes of nibbles -> 32 bytes: low nibbles (weights 0..15), then high (16..31).
static inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// sum of u8 * s8 products, 8 int32 lanes, as floats (no overflow: |pair| <= 255 * 128 * 2 < 2^16
// only for u8 <= 127 or the signs below, which is all that is passed here)
static inline __m256 dot_u8_s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// s8 * s8: move the sign of w onto x, so that maddubs sees |w| (u8 <= 128) times s8.
static inline __m256 dot_s8_s8(__m256i w, __m256i x) {
  return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// A block's 32 weights as bytes: int8 (Q8_0), q - 8 (Q4_0), q in 0..15 (Q4_1).
template <int64_t TYPE>
static inline __m256i load_block(const uint8_t* p) {
  if constexpr (TYPE == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  else if constexpr (TYPE == Q4_0) return _mm256_sub_epi8(unpack_nibbles(p), _mm256_set1_epi8(8));
  else return unpack_nibbles(p);
}

template <int64_t TYPE>
static inline __m256 block_dot(__m256i qw, __m256i qx) {
  if constexpr (TYPE == Q4_1) return dot_u8_s8(qw, qx);
  else return dot_s8_s8(qw, qx);
}
#endif

// One weight row against MT quantized rows of x: out[m] = sum_b dot_b * d_w * d_x (+ m_w * s_x).
template <int64_t TYPE, int MT>
static void dot_row_int8(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, int64_t nb,
                         const QuantizedRow* xs, float* out) {
#ifdef LLMOPT_AVX2
  constexpr int BYTES = TYPE == Q8_0 ? 32 : 16;
  __m256 acc[MT];
  float summs[MT];
  for (int m = 0; m < MT; ++m) { acc[m] = _mm256_setzero_ps(); summs[m] = 0.0f; }
  for (int64_t b = 0; b < nb; ++b) {
    const float dw = fp16_to_float(wd[b]);
    const __m256i qw = load_block<TYPE>(w + b * BYTES);
    for (int m = 0; m < MT; ++m) {
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[m].q + b * QK));
      const __m256 p = block_dot<TYPE>(qw, qx);
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xs[m].d[b]), p, acc[m]);
      if constexpr (TYPE == Q4_1) summs[m] += fp16_to_float(wm[b]) * xs[m].s[b];
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum8(acc[m]) + summs[m];
#else
  for (int m = 0; m < MT; ++m) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      int sum = 0;
      for (int j = 0; j < QK; ++j) {
        int q;
        if (TYPE == Q8_0) q = int8_t(w[b * 32 + j]);
        else q = (j < 16 ? w[b * 16 + j] & 15 : w[b * 16 + j - 16] >> 4) - (TYPE == Q4_0 ? 8 : 0);
        sum += q * xs[m].q[b * QK + j];
      }
      total += float(sum) * (fp16_to_float(wd[b]) * xs[m].d[b]);
      if (TYPE == Q4_1) total += fp16_to_float(wm[b]) * xs[m].s[b];
    }
    out[m] = total;
  }
#endif
}

// Decode (one row of x): R weight rows at a time, so that the R accumulator chains run in
// parallel (one FMA chain alone waits 4 cycles a block) and each block of x is loaded once.
template <int64_t TYPE, int R>
static void dot_rows_int8(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, int64_t nb,
                          int64_t row_stride, const QuantizedRow& x, float* out) {
#ifdef LLMOPT_AVX2
  constexpr int BYTES = TYPE == Q8_0 ? 32 : 16;
  __m256 acc[R];
  float summs[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); summs[r] = 0.0f; }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * QK));
    const float dx = x.d[b];
    for (int r = 0; r < R; ++r) {
      const __m256 p = block_dot<TYPE>(load_block<TYPE>(w + r * row_stride * BYTES + b * BYTES), qx);
      if constexpr (TYPE == Q4_1) summs[r] += fp16_to_float(wm[r * row_stride + b]) * x.s[b];
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_float(wd[r * row_stride + b]) * dx), p, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) + summs[r];
#else
  for (int r = 0; r < R; ++r)
    dot_row_int8<TYPE, 1>(w + r * row_stride * (TYPE == Q8_0 ? 32 : 16), wd + r * row_stride,
                          wm ? wm + r * row_stride : nullptr, nb, &x, out + r);
#endif
}

// The weights dequantized in registers, times fp32 x.
template <int64_t TYPE, int MT>
static void dot_row_f32(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, int64_t nb,
                        const float* const* xs, float* out) {
  float acc[MT] = {};
#ifdef LLMOPT_AVX2
  __m256 a[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int k = 0; k < 4; ++k) a[m][k] = _mm256_setzero_ps();
#endif
  for (int64_t b = 0; b < nb; ++b) {
    alignas(32) float wf[QK];
    const float d = fp16_to_float(wd[b]);
    const float mn = TYPE == Q4_1 ? fp16_to_float(wm[b]) : 0.0f;
    for (int j = 0; j < QK; ++j) {
      int q;
      if (TYPE == Q8_0) q = int8_t(w[b * 32 + j]);
      else q = (j < 16 ? w[b * 16 + j] & 15 : w[b * 16 + j - 16] >> 4) - (TYPE == Q4_0 ? 8 : 0);
      wf[j] = TYPE == Q4_1 ? float(q) * d + mn : float(q) * d;
    }
#ifdef LLMOPT_AVX2
    for (int k = 0; k < 4; ++k) {
      const __m256 wk = _mm256_load_ps(wf + 8 * k);
      for (int m = 0; m < MT; ++m)
        a[m][k] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(xs[m] + b * QK + 8 * k), a[m][k]);
    }
#else
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < QK; ++j) acc[m] += wf[j] * xs[m][b * QK + j];
#endif
  }
#ifdef LLMOPT_AVX2
  for (int m = 0; m < MT; ++m)
    acc[m] = hsum8(_mm256_add_ps(_mm256_add_ps(a[m][0], a[m][1]), _mm256_add_ps(a[m][2], a[m][3])));
#endif
  for (int m = 0; m < MT; ++m) out[m] = acc[m];
}

}  // namespace llmopt
