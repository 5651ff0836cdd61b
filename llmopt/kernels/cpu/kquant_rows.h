// The row kernels of kquant_matmul.cpp: one weight row of GGUF k-quant super-blocks (Q4_K, Q6_K)
// against up to 4 rows of x, with AVX2 where the CPU has it and in plain C++ where it does not.
//
// A super-block is 256 weights with one fp16 scale d, split into sub-blocks whose own scales are
// small integers (llmopt/quant/kquants.py holds the byte layouts and their numpy quantizers):
//
//   Q4_K  144 bytes: d, dmin (fp16) | 12 bytes of 6-bit sc_j, m_j (8 sub-blocks of 32) | 128 bytes
//         of 4-bit q, in 4 chunks of 32 bytes: chunk c's low nibbles are sub-block 2c, its high
//         ones 2c + 1.                                   w = d * sc_j * q - dmin * m_j
//   Q6_K  210 bytes: ql[128] (low 4 bits) | qh[64] (top 2 bits) | sc[16] int8 | d (fp16); weight
//         128 h + r is nibble r / 64 of ql[64 h + r % 64] and bits 2 (r / 32) of qh[32 h + r % 32].
//                                                        w = d * sc_j * (q - 32), 16 sub-blocks of 16
//
// int8 activations (llama.cpp's arithmetic for k-quants, its Q8_K): each 256 values of a row of x
// become int8 codes with one fp32 scale, and the sums of each 16 (bsums) and each 32 codes ride
// along. A super-block's dot product is then whole integers, scaled twice:
//   Q4_K  d_x * d * sum_j sc_j * (q_j . x_j)  -  d_x * dmin * sum_j m_j * sum(x_j)
//   Q6_K  d_x * d * sum_j sc_j * (q_j . x_j  -  32 * sum(x_j))
// The minimum and the offset of 32 leave the inner loop: they need only x's sums, already known,
// so the inner loop multiplies unsigned codes (0..15, 0..63) by signed x, which is exactly what
// AVX2's maddubs does (u8 * s8, adjacent pairs summed to int16), and madd then multiplies those
// pairs by the sub-block's scale and sums them to int32. Nothing overflows: a pair is at most
// 2 * 63 * 127 = 16,002 < 2^15, and a lane's int32 sum stays far below 2^31.
//
// float32 activations: each super-block is dequantized in registers (d * sc_j, and dmin * m_j,
// rounded to fp32 first, as gguf.quants.dequantize computes them) and multiplied by unrounded x.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace llmopt {

constexpr int64_t QK_K = 256;
enum KQuantType : int64_t { Q4_K = 12, Q6_K = 14 };  // llama.cpp's ggml_type numbers

constexpr int64_t kquant_bytes(int64_t type) { return type == Q4_K ? 144 : 210; }

// One row of x as Q8_K: q int8 [K], d fp32 [K / 256], bsums [K / 16] and sums32 [K / 32] (the
// sums of each 16 and each 32 codes, which Q6_K's offset and Q4_K's minimum term multiply).
struct Q8KRow {
  const int8_t* q;
  const float* d;
  const int16_t* bsums;
  const int16_t* sums32;
};

// Q4_K's 12 bytes of scales -> sc[8] and m[8], each 0..63. Bytes 0-3 hold sc_0..3 in their low
// 6 bits, bytes 4-7 m_0..3; bytes 8-11 hold the low 4 bits of sc_4..7 (low nibble) and m_4..7
// (high nibble), whose top 2 bits are the top 2 bits of bytes 0-3 (sc) and 4-7 (m). Four bytes at
// a time: a shift by 2 moves bits 6-7 of each byte to bits 4-5 of the same byte.
static inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t sc03 = a & 0x3F3F3F3Fu, m03 = b & 0x3F3F3F3Fu;
  const uint32_t sc47 = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
  const uint32_t m47 = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  std::memcpy(sc, &sc03, 4);
  std::memcpy(sc + 4, &sc47, 4);
  std::memcpy(mn, &m03, 4);
  std::memcpy(mn + 4, &m47, 4);
}

static inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_float(h);
}

// A super-block's 256 codes in weight order (Q4_K 0..15, Q6_K 0..63), plain C++: the fallback's
// and the float32 path's view of the bytes.
template <int64_t TYPE>
static inline void kquant_codes(const uint8_t* b, uint8_t* codes) {
  if constexpr (TYPE == Q4_K) {
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 32; ++i) {
        codes[64 * c + i] = qs[32 * c + i] & 15;
        codes[64 * c + 32 + i] = qs[32 * c + i] >> 4;
      }
  } else {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 128; ++r) {
        const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
        const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        codes[128 * h + r] = uint8_t(low | (high << 4));
      }
  }
}

#ifdef LLMOPT_AVX2

static inline float hsum4_k(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q6_K: the 32 codes of weights 128 h + 32 g .. + 31 (sub-blocks 8 h + 2 g and 8 h + 2 g + 1), from
// the half's ql bytes A = ql[64 h ..], B = ql[64 h + 32 ..] and qh bytes Q = qh[32 h ..]. The top 2
// bits are bits 2 g of Q, moved to bits 4-5 by a 16-bit shift (the mask drops what crossed bytes).
template <int G>
static inline __m256i q6k_group(__m256i A, __m256i B, __m256i Q) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  const __m256i low = G == 0 ? _mm256_and_si256(A, low4)
                    : G == 1 ? _mm256_and_si256(B, low4)
                    : G == 2 ? _mm256_and_si256(_mm256_srli_epi16(A, 4), low4)
                             : _mm256_and_si256(_mm256_srli_epi16(B, 4), low4);
  const __m256i high = G == 0 ? _mm256_slli_epi16(Q, 4)
                     : G == 1 ? _mm256_slli_epi16(Q, 2)
                     : G == 2 ? Q
                              : _mm256_srli_epi16(Q, 2);
  return _mm256_or_si256(low, _mm256_and_si256(high, top2));
}

// 16-bit lane J of v in all 16 lanes (v holds the same 8 lanes in both 128-bit halves).
template <int J>
static inline __m256i broadcast16(__m256i v) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(short(((2 * J + 1) << 8) | (2 * J))));
}

// Q6_K's int8 scales J and J + 1, each widened to int16 over one 128-bit half (8 lanes each:
// a maddubs of 32 codes puts sub-block J's pairs in the low half, J + 1's in the high one).
template <int J>
static inline __m256i q6k_scale_pair(__m128i sc8) {
  const __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (J + 1), 0x0101010101010101LL * J);
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
}
#endif

// out[m] = the dot product of one weight row (nsb super-blocks at w) with MT rows of Q8_K x.
template <int64_t TYPE, int MT>
static void kquant_row_int8(const uint8_t* w, int64_t nsb, const Q8KRow* xs, float* out) {
  constexpr int64_t BYTES = kquant_bytes(TYPE);
#ifdef LLMOPT_AVX2
  __m256 acc[MT];
  __m128 acc_min[MT];  // Q4_K's minimum term, 4 lanes of its 8 sub-blocks' sums
  for (int m = 0; m < MT; ++m) { acc[m] = _mm256_setzero_ps(); acc_min[m] = _mm_setzero_ps(); }
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* b = w + s * BYTES;
    for (int64_t line = 0; line < BYTES; line += 64)  // common.h: PREFETCH_BYTES
      _mm_prefetch(reinterpret_cast<const char*>(b + PREFETCH_BYTES + line), _MM_HINT_T0);
    __m256i sumi[MT];
    float d;
    if constexpr (TYPE == Q4_K) {
      d = fp16_at(b);
      const float dmin = fp16_at(b + 2);
      alignas(8) uint8_t sc[8], mn[8];
      q4k_scales(b + 4, sc, mn);
      const __m128i sc16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
      const __m256i scales = _mm256_broadcastsi128_si256(sc16);
      const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
      for (int m = 0; m < MT; ++m) {
        sumi[m] = _mm256_setzero_si256();
        const __m128i x32 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs[m].sums32 + s * 8));
        acc_min[m] = _mm_fmadd_ps(_mm_set1_ps(dmin * xs[m].d[s]), _mm_cvtepi32_ps(_mm_madd_epi16(mins, x32)),
                                  acc_min[m]);
      }
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      auto chunk = [&](auto c_const) {
        constexpr int c = decltype(c_const)::value;
        const __m256i q4 = load256(b + 16 + 32 * c);
        const __m256i lo = _mm256_and_si256(q4, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4);
        const __m256i s_lo = broadcast16<2 * c>(scales), s_hi = broadcast16<2 * c + 1>(scales);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = xs[m].q + s * QK_K + 64 * c;
          const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(xq)), s_lo);
          const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(xq + 32)), s_hi);
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p_lo, p_hi));
        }
      };
      chunk(std::integral_constant<int, 0>{});
      chunk(std::integral_constant<int, 1>{});
      chunk(std::integral_constant<int, 2>{});
      chunk(std::integral_constant<int, 3>{});
    } else {
      d = fp16_at(b + 208);
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      for (int m = 0; m < MT; ++m)  // - 32 * sum_j sc_j * sum(x_j): the codes' offset, once per super-block
        sumi[m] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_slli_epi32(_mm256_madd_epi16(sc16, load256(xs[m].bsums + s * 16)), 5));
      for (int h = 0; h < 2; ++h) {
        const __m256i A = load256(b + 64 * h), B = load256(b + 64 * h + 32), Q = load256(b + 128 + 32 * h);
        auto group = [&](auto g_const) {
          constexpr int g = decltype(g_const)::value;
          const __m256i q6 = q6k_group<g>(A, B, Q);
          const __m256i scale = h == 0 ? q6k_scale_pair<2 * g>(sc8) : q6k_scale_pair<8 + 2 * g>(sc8);
          for (int m = 0; m < MT; ++m) {
            const __m256i xq = load256(xs[m].q + s * QK_K + 128 * h + 32 * g);
            sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q6, xq), scale));
          }
        };
        group(std::integral_constant<int, 0>{});
        group(std::integral_constant<int, 1>{});
        group(std::integral_constant<int, 2>{});
        group(std::integral_constant<int, 3>{});
      }
    }
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[m].d[s]), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
  }
  for (int m = 0; m < MT; ++m) out[m] = hsum8(acc[m]) - hsum4_k(acc_min[m]);
#else
  float total[MT] = {};
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* b = w + s * BYTES;
    uint8_t codes[QK_K];
    kquant_codes<TYPE>(b, codes);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xq = xs[m].q + s * QK_K;
      int32_t sum = 0, sum_min = 0;
      if constexpr (TYPE == Q4_K) {
        uint8_t sc[8], mn[8];
        q4k_scales(b + 4, sc, mn);
        for (int j = 0; j < 8; ++j) {
          int32_t dot = 0;
          for (int i = 0; i < 32; ++i) dot += int32_t(codes[32 * j + i]) * xq[32 * j + i];
          sum += sc[j] * dot;
          sum_min += mn[j] * xs[m].sums32[s * 8 + j];
        }
        total[m] += fp16_at(b) * xs[m].d[s] * float(sum) - fp16_at(b + 2) * xs[m].d[s] * float(sum_min);
      } else {
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        for (int j = 0; j < 16; ++j) {
          int32_t dot = 0;
          for (int i = 0; i < 16; ++i) dot += int32_t(codes[16 * j + i]) * xq[16 * j + i];
          sum += sc[j] * (dot - 32 * xs[m].bsums[s * 16 + j]);
        }
        total[m] += fp16_at(b + 208) * xs[m].d[s] * float(sum);
      }
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = total[m];
#endif
}

// A super-block dequantized: w_i = a[i / 16] * (codes[i] - OFFSET) - b[i / 16] (OFFSET 0 for
// Q4_K, 32 for Q6_K; b 0 for Q6_K), a and b rounded to fp32 as gguf.quants rounds them.
template <int64_t TYPE>
static inline void kquant_scales_f32(const uint8_t* b, float* a, float* off) {
  if constexpr (TYPE == Q4_K) {
    const float d = fp16_at(b), dmin = fp16_at(b + 2);
    uint8_t sc[8], mn[8];
    q4k_scales(b + 4, sc, mn);
    for (int j = 0; j < 16; ++j) {
      a[j] = d * float(sc[j / 2]);
      off[j] = dmin * float(mn[j / 2]);
    }
  } else {
    const float d = fp16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int j = 0; j < 16; ++j) {
      a[j] = d * float(sc[j]);
      off[j] = 0.0f;
    }
  }
}

// out[m] = one weight row, dequantized in registers, times MT rows of fp32 x.
template <int64_t TYPE, int MT>
static void kquant_row_f32(const uint8_t* w, int64_t nsb, const float* const* xs, float* out) {
  constexpr int64_t BYTES = kquant_bytes(TYPE);
  constexpr float OFFSET = TYPE == Q6_K ? 32.0f : 0.0f;
#ifdef LLMOPT_AVX2
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
#else
  float total[MT] = {};
#endif
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* b = w + s * BYTES;
    alignas(32) uint8_t codes[QK_K];
    float a[16], off[16];
    kquant_scales_f32<TYPE>(b, a, off);
#ifdef LLMOPT_AVX2
    if constexpr (TYPE == Q4_K) {
      for (int c = 0; c < 4; ++c) {
        const __m256i q4 = load256(b + 16 + 32 * c), low4 = _mm256_set1_epi8(0x0F);
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 64 * c), _mm256_and_si256(q4, low4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 64 * c + 32),
                           _mm256_and_si256(_mm256_srli_epi16(q4, 4), low4));
      }
    } else {
      for (int h = 0; h < 2; ++h) {
        const __m256i A = load256(b + 64 * h), B = load256(b + 64 * h + 32), Q = load256(b + 128 + 32 * h);
        __m256i* dst = reinterpret_cast<__m256i*>(codes + 128 * h);
        _mm256_store_si256(dst, q6k_group<0>(A, B, Q));
        _mm256_store_si256(dst + 1, q6k_group<1>(A, B, Q));
        _mm256_store_si256(dst + 2, q6k_group<2>(A, B, Q));
        _mm256_store_si256(dst + 3, q6k_group<3>(A, B, Q));
      }
    }
    for (int j = 0; j < 16; ++j) {
      const __m256 va = _mm256_set1_ps(a[j]), voff = _mm256_set1_ps(off[j]);
      for (int half = 0; half < 2; ++half) {
        const int i = 16 * j + 8 * half;
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))));
        if constexpr (TYPE == Q6_K) q = _mm256_sub_ps(q, _mm256_set1_ps(OFFSET));
        const __m256 wv = _mm256_sub_ps(_mm256_mul_ps(va, q), voff);
        for (int m = 0; m < MT; ++m)
          acc[m][half] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[m] + s * QK_K + i), acc[m][half]);
      }
    }
#else
    kquant_codes<TYPE>(b, codes);
    for (int i = 0; i < QK_K; ++i) {
      const float wv = a[i / 16] * (float(codes[i]) - OFFSET) - off[i / 16];
      for (int m = 0; m < MT; ++m) total[m] += wv * xs[m][s * QK_K + i];
    }
#endif
  }
#ifdef LLMOPT_AVX2
  for (int m = 0; m < MT; ++m) out[m] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
#else
  for (int m = 0; m < MT; ++m) out[m] = total[m];
#endif
}

}  // namespace llmopt
