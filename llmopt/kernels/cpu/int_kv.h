// The int8 / int4 KV pool (kv_cache_dtype="int8" | "int4"): reading a row back and writing a
// step's tokens, the same arithmetic as llmopt/kernels/int_kv_ref.py (its docstring says the
// format: KIVI's grouping, keys grouped per block and channel, values per token and channels;
// int8 symmetric with E8M0 power-of-two scales, int4 asymmetric with a float16 scale and minimum),
// held equal to it bit for bit by the tests: so no fused multiply-adds here (torch rounds a
// product before adding it).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace llmopt::intkv {

inline int64_t value_group(bool four) { return four ? 64 : 32; }

// -- int8: symmetric codes, E8M0 scales -----------------------------------------------------------

// An E8M0 byte as the power of two it stands for: the byte is the float's exponent field.
inline float scale_of(uint8_t b) {
  const uint32_t u = uint32_t(b) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The smallest power of two s with amax / s <= 127, as its byte (1 for amax 0: codes round to 0).
inline uint8_t scale_byte(float amax) {
  if (!(amax > 0.0f)) return 1;
  int e;
  const float m = std::frexp(amax / 127.0f, &e);  // amax / 127 = m * 2^e, m in [0.5, 1)
  if (m == 0.5f) e -= 1;
  return uint8_t(std::clamp(e + 127, 1, 254));
}

inline int8_t quantize8(float x, float s) {   // half to even, as torch.round
  return int8_t(std::clamp(std::nearbyint(x / s), -127.0f, 127.0f));
}

// -- int4: asymmetric codes 0..15, a float16 scale and minimum per group -------------------------

inline float h2f(c10::Half h) { return static_cast<float>(h); }

// A group spanning lo..hi: g[0] = (hi - lo) / 15, g[1] = lo, each rounded to float16.
inline void group_of(float lo, float hi, c10::Half* g) {
  g[0] = c10::Half((hi - lo) / 15.0f);
  g[1] = c10::Half(lo);
}

inline uint8_t quantize4(float x, const c10::Half* g) {
  const float s = h2f(g[0]), m = h2f(g[1]);
  if (!(s > 0.0f)) return 0;
  return uint8_t(std::clamp(std::nearbyint((x - m) / s), 0.0f, 15.0f));
}

inline float dequantize4(int q, const c10::Half* g) {
  const float p = float(q) * h2f(g[0]);
  return p + h2f(g[1]);
}

// Channel j of a row of D: the low nibble of byte j for the first half, the high nibble of byte
// j - D / 2 for the second (so a read unpacks two contiguous halves, no interleaving).
inline int nibble(const uint8_t* row, int64_t j, int64_t D) {
  return j < D / 2 ? row[j] & 15 : row[j - D / 2] >> 4;
}

inline void set_nibble(uint8_t* row, int64_t j, int64_t D, uint8_t q) {
  const int64_t i = j < D / 2 ? j : j - D / 2;
  const int shift = j < D / 2 ? 0 : 4;
  row[i] = uint8_t((row[i] & ~(15 << shift)) | (q << shift));
}

// -- reading (the attention kernel's loads) ---------------------------------------------------

// A (block, KV head)'s key groups decoded to floats once for the block's tokens, and a value row's
// few groups once each: codes times scale (plus minimum, int4), as int_kv_ref reads them.
struct KeyGroups {
  int64_t at = -1;          // which block * Hkv + head is decoded
  std::vector<float> s, m;  // per channel: scale, minimum (0 for int8)
  void decode(const void* groups, int64_t index, bool four, int64_t D) {
    if (at == index) return;
    at = index;
    s.resize(D);
    m.assign(D, 0.0f);
    if (!four) {
      const auto* b = static_cast<const uint8_t*>(groups) + index * D;
      for (int64_t j = 0; j < D; ++j) s[j] = scale_of(b[j]);
    } else {
      const auto* g = static_cast<const c10::Half*>(groups) + index * D * 2;
      for (int64_t j = 0; j < D; ++j) { s[j] = h2f(g[2 * j]); m[j] = h2f(g[2 * j + 1]); }
    }
  }
};

inline void load_key(const void* codes, const KeyGroups& kg, bool four, int64_t D, float* dst) {
  if (!four) {
    const auto* c = static_cast<const int8_t*>(codes);
    for (int64_t j = 0; j < D; ++j) dst[j] = float(c[j]) * kg.s[j];
    return;
  }
  const auto* c = static_cast<const uint8_t*>(codes);
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float p = float(c[i] & 15) * kg.s[i];
    dst[i] = p + kg.m[i];
  }
  for (int64_t i = 0; i < half; ++i) {
    const float p = float(c[i] >> 4) * kg.s[half + i];
    dst[half + i] = p + kg.m[half + i];
  }
}

inline void load_value(const void* codes, const void* groups, bool four, int64_t D, float* dst) {
  const int64_t G = value_group(four);
  for (int64_t g0 = 0; g0 < D; g0 += G) {
    if (!four) {
      const auto* c = static_cast<const int8_t*>(codes);
      const float s = scale_of(static_cast<const uint8_t*>(groups)[g0 / G]);
      for (int64_t j = g0; j < g0 + G; ++j) dst[j] = float(c[j]) * s;
    } else {
      const auto* c = static_cast<const uint8_t*>(codes);
      const c10::Half* gr = static_cast<const c10::Half*>(groups) + 2 * (g0 / G);
      const float s = h2f(gr[0]), m = h2f(gr[1]);
      for (int64_t j = g0; j < g0 + G; ++j) {
        const float p = float(nibble(c, j, D)) * s;
        dst[j] = p + m;
      }
    }
  }
}

// -- writing a step's tokens --------------------------------------------------------------------

// k(t), v(t): token t's [Hkv * D] keys and values at k + t * stride, in the model's dtype; slots[t]
// its slot. Pools [NB, BS, Hkv, D * bits / 8]; groups as int_kv_ref.scale_shapes says. Tokens of
// one block come together, in order (the engine's step).
template <typename T>
void write(const T* k, const T* v, int64_t stride, const int64_t* slots, int64_t tokens, const at::Tensor& k_pool,
           const at::Tensor& v_pool, const at::Tensor& k_groups, const at::Tensor& v_groups, int64_t Hkv, int64_t D) {
  const bool four = k_pool.scalar_type() == at::kByte;
  const int64_t BS = k_pool.size(1), W = k_pool.size(3), G = value_group(four), NG = D / G;
  uint8_t* kp = static_cast<uint8_t*>(k_pool.data_ptr());
  uint8_t* vp = static_cast<uint8_t*>(v_pool.data_ptr());
  auto* kg8 = static_cast<uint8_t*>(k_groups.data_ptr());
  auto* vg8 = static_cast<uint8_t*>(v_groups.data_ptr());
  auto* kg4 = static_cast<c10::Half*>(k_groups.data_ptr());
  auto* vg4 = static_cast<c10::Half*>(v_groups.data_ptr());
  // values: each token's groups on their own
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < Hkv; ++h) {
      const T* x = v + t * stride + h * D;
      const int64_t row = slots[t] * Hkv + h;
      for (int64_t g = 0; g < NG; ++g) {
        float amax = 0.0f, lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (int64_t j = g * G; j < (g + 1) * G; ++j) {
          const float f = float(x[j]);
          amax = std::max(amax, std::fabs(f)); lo = std::min(lo, f); hi = std::max(hi, f);
        }
        if (!four) {
          const uint8_t b = vg8[row * NG + g] = scale_byte(amax);
          for (int64_t j = g * G; j < (g + 1) * G; ++j)
            reinterpret_cast<int8_t*>(vp)[row * W + j] = quantize8(float(x[j]), scale_of(b));
        } else {
          c10::Half* gr = vg4 + (row * NG + g) * 2;
          group_of(lo, hi, gr);
          for (int64_t j = g * G; j < (g + 1) * G; ++j) set_nibble(vp + row * W, j, D, quantize4(float(x[j]), gr));
        }
      }
    }
  // keys: per run of tokens in one block, each channel's group over them and the block's earlier tokens
  for (int64_t t0 = 0; t0 < tokens;) {
    const int64_t block = slots[t0] / BS;
    int64_t t1 = t0, first = BS;
    for (; t1 < tokens && slots[t1] / BS == block; ++t1) first = std::min(first, slots[t1] % BS);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t j = 0; j < D; ++j) {
        float amax = 0.0f, lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (int64_t t = t0; t < t1; ++t) {
          const float f = float(k[t * stride + h * D + j]);
          amax = std::max(amax, std::fabs(f)); lo = std::min(lo, f); hi = std::max(hi, f);
        }
        auto earlier_row = [&](int64_t o) { return kp + ((block * BS + o) * Hkv + h) * W; };
        if (!four) {
          uint8_t& sc = kg8[(block * Hkv + h) * D + j];
          const uint8_t old = first > 0 ? sc : 0;
          const uint8_t now = std::max(old, scale_byte(amax));
          if (first > 0 && now > old) {   // earlier codes of this channel: divided by the ratio, rounded again
            const float ratio = scale_of(old) / scale_of(now);
            for (int64_t o = 0; o < first; ++o) {
              int8_t* c = reinterpret_cast<int8_t*>(earlier_row(o)) + j;
              *c = int8_t(std::nearbyint(float(*c) * ratio));
            }
          }
          sc = now;
          for (int64_t t = t0; t < t1; ++t)
            reinterpret_cast<int8_t*>(kp)[(slots[t] * Hkv + h) * W + j] = quantize8(float(k[t * stride + h * D + j]), scale_of(now));
        } else {
          c10::Half* gr = kg4 + ((block * Hkv + h) * D + j) * 2;
          if (first > 0) {
            const c10::Half old[2] = {gr[0], gr[1]};
            const float old_lo = h2f(old[1]), old_hi = h2f(old[0]) * 15.0f + h2f(old[1]);
            lo = std::min(lo, old_lo);
            hi = std::max(hi, old_hi);
            if (lo < old_lo || hi > old_hi) {   // earlier codes: read back on the old grid, quantized on the new
              group_of(lo, hi, gr);
              for (int64_t o = 0; o < first; ++o)
                set_nibble(earlier_row(o), j, D, quantize4(dequantize4(nibble(earlier_row(o), j, D), old), gr));
            }
          } else {
            group_of(lo, hi, gr);
          }
          for (int64_t t = t0; t < t1; ++t)
            set_nibble(kp + (slots[t] * Hkv + h) * W, j, D, quantize4(float(k[t * stride + h * D + j]), gr));
        }
      }
    t0 = t1;
  }
}

}  // namespace llmopt::intkv

#pragma GCC pop_options
