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

}  // namespace llmopt
