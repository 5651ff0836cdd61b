// What the CPU kernels share: number formats widened to fp32, and the vector ISA in use.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMOPT_AVX2 1
#endif

namespace llmopt {

// How far ahead of its loads a weight row streamed at one row of x asks for its bytes
// (_mm_prefetch): the hardware prefetchers alone left the GGUF Q4_0 and Q8_0 rows at 17-24 GB/s on a
// 2-core AMD EPYC whose STREAM triad reads 31; 2 KB ahead (about 130 ns of one core's stream, a
// DRAM latency) read 25-31.
constexpr int64_t PREFETCH_BYTES = 2048;

#ifdef LLMOPT_AVX2
// The sum of a vector's 8 floats (the last step of every AVX2 dot product).
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does (NaN stays NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
#ifdef LLMOPT_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &bits, 4);
  }
  uint32_t out;
  std::memcpy(&out, &f, 4);
  out |= sign;
  std::memcpy(&f, &out, 4);
  return f;
#endif
}

// float -> fp16 -> float, round to nearest even (what storing a scale as ggml_half does).
inline float round_to_fp16(float f) {
#ifdef LLMOPT_AVX2
  return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  if (!std::isfinite(f) || f == 0.0f) return f;
  int e;
  std::frexp(f, &e);                       // |f| in [2^(e-1), 2^e)
  int step_exp = (e - 1 < -14 ? -14 : e - 1) - 10;
  float step = std::ldexp(1.0f, step_exp);
  float r = std::nearbyint(f / step) * step;
  return std::fabs(r) > 65504.0f ? std::copysign(INFINITY, f) : r;
#endif
}


#if defined(__AVX512F__)
// e^x per lane for x <= 0 (exp_shifted_add below says which polynomial; prompt and decode attention share it).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}
#endif

// s[i] = exp(s[i] - mx) for i < n, in place, each added to l (one at a time, in order, without AVX-512). Softmax's exponentials: with
// AVX-512, 16 at a time (Cephes' expf polynomial on [-ln2/2, ln2/2], within 2 ulp of std::exp),
// which took about 10% off a 64-sequence decode step's attention. Elsewhere std::exp, one at a
// time: the lessons pin AVX2 (lessons/README) and their stored outputs were computed with it, so
// an AVX2 polynomial would change the last bits of every attention output they show.
inline void exp_shifted_add(float* s, int64_t n, float mx, float& l) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  l += _mm512_reduce_add_ps(vsum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    l += s[i];
  }
}

}  // namespace llmopt
