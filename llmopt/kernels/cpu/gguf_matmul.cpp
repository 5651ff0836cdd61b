// y = x @ W^T with W held as GGUF Q8_0 / Q4_0 / Q4_1 blocks (32 weights, an fp16 scale d,
// and for Q4_1 an fp16 min m), the arithmetic llama.cpp runs on a CPU.
//
// Why this arithmetic at small M (decode): a step reads every weight once, so the kernel
// must spend fewer cycles per weight than the memory needs to deliver it. On AVX2 (this
// course's EPYC exposes AVX2 + FMA + F16C, no AVX-512) multiplying int8 by int8 does 32
// products per instruction pair (maddubs + madd), where widening the weights to fp32 and
// using FMA does 8, and the widening costs more instructions than the products. So, as
// llama.cpp does, each row of x is quantized per 32 values to int8 (Q8_0: d = amax / 127,
// stored as fp16; for Q4_1 also s = d * sum(q), Q8_1), block dot products are exact int32
// sums, and each block adds sum * d_w * d_x to fp32 accumulators. `gguf_matmul_f32` is the
// other choice, the weights dequantized in registers times fp32 x: no rounding of x at all,
// about twice the instructions.
//
// Threads split the output rows (at::parallel_for). Up to 4 rows of x share one decoding
// of a weight block, and a weight row (a few hundred bytes) stays in L1 while further
// tiles of x run over it; past a few dozen rows a dense matmul wins (the caller decides).
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstring>
#include <vector>

#include "common.h"
#include "gguf_vnni.h"

namespace llmopt {

constexpr int QK = 32;
// Decode takes 4 weight rows at a time only while the weight stays in cache (measured on
// SmolLM2: 3072 x 576 Q8_0 at 1 row of x, 118 vs 195 us on one thread). A weight streamed from
// memory runs slower that way (the 49152 x 576 head: 4.2 vs 2.3 ms), its four interleaved
// streams defeating the prefetcher, so from this size on rows go one at a time.
constexpr int64_t MULTI_ROW_MAX_BYTES = 8 << 20;
enum GGMLType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

// One row of x quantized per 32 values: q int8 [K], d and s (fp16-rounded floats) [K / 32].
struct QuantizedRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* c = nullptr;  // VNNI Q8_0 (signed codes): -bias * (sum of each 4 values of q)
  const int8_t* split = nullptr;     // VNNI Q4: q per four blocks, their values 0..15 then 16..31
  const int32_t* split_c = nullptr;  // VNNI Q4_0: -8 * (sum of the 8 values of split each lane meets)
};

// Every call quantizes its x before the threads split the rows, so at one row of x this serial
// loop is part of each matmul's fixed cost: with AVX-512 a block is two vectors (the same IEEE
// operations, so the same bytes as the scalar loop; a NaN is skipped by the max as by fmax).
static void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d_out, float* s_out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
#if defined(__AVX512F__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16), sign = _mm512_set1_ps(-0.0f);
    const __m512 mx = _mm512_max_ps(_mm512_andnot_ps(sign, x1), _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(mx);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x0, _mm512_set1_ps(id)), RN));
    const __m512i v1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x1, _mm512_set1_ps(id)), RN));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK), _mm512_cvtepi32_epi8(v0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK + 16), _mm512_cvtepi32_epi8(v1));
    d_out[b] = round_to_fp16(d);
    s_out[b] = round_to_fp16(d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1))));
#else
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      int v = int(std::nearbyint(xb[j] * id));   // round half to even, as _mm256_round_ps
      q[b * QK + j] = int8_t(v);
      sum += v;
    }
    d_out[b] = round_to_fp16(d);
    s_out[b] = round_to_fp16(d * float(sum));
#endif
  }
}

#ifdef LLMOPT_AVX2
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

#ifdef LLMOPT_VNNI512
// Weight rows n..n1 against x rows m0..m0 + MT through the VNNI tile (gguf_vnni.h), R rows of W
// at a time (1 for the last few of a thread's share).
template <int64_t TYPE, int R, int MT>
static void vnni_rows(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, int64_t N,
                      const QuantizedRow* xs, int64_t n, int64_t n1, int64_t m0, float* y) {
  constexpr int64_t BYTES = TYPE == Q8_0 ? 32 : 16;
  float out[R * MT];
  for (; n + R <= n1; n += R) {
    vnni::block_tile<TYPE, R, MT>(wq + n * nb * BYTES, wd + n * nb, wm ? wm + n * nb : nullptr, nb, xs + m0, out);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n + r] = out[r * MT + m];
  }
  for (; n < n1; ++n) {
    vnni::block_tile<TYPE, 1, MT>(wq + n * nb * BYTES, wd + n * nb, wm ? wm + n * nb : nullptr, nb, xs + m0, out);
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n] = out[m];
  }
}

// All M rows of x in passes of 4 (R x MT accumulators: 1 x 1 for one row, 2 x MT for more).
// One row of x takes one weight row at a time: measured on SmolLM2's Q4_1 layers and Q8_0 head on
// an AVX-512 EPYC (2 threads, interleaved runs), the 30 layers' matmuls took 3.1-4.2 ms that way
// against 4.2-5.9 with 4 rows a tile, and the head 1.0-1.3 ms against 1.9-2.2 (8 rows: as 4).
// Likely why, as on the AVX2 path above: one row is one sequential stream for the prefetchers,
// four rows are four streams a row apart. (4 rows were chosen earlier on a Xeon, not re-measured.)
template <int64_t TYPE>
static void vnni_all(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, int64_t N, int64_t M,
                     const QuantizedRow* xs, int64_t n0, int64_t n1, float* y) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: vnni_rows<TYPE, 1, 1>(wq, wd, wm, nb, N, xs, n0, n1, m0, y); break;
      case 2: vnni_rows<TYPE, 2, 2>(wq, wd, wm, nb, N, xs, n0, n1, m0, y); break;
      case 3: vnni_rows<TYPE, 2, 3>(wq, wd, wm, nb, N, xs, n0, n1, m0, y); break;
      default: vnni_rows<TYPE, 2, 4>(wq, wd, wm, nb, N, xs, n0, n1, m0, y);
    }
  }
}
#endif

static void check_weight(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                         const at::Tensor& mn, int64_t type) {
  TORCH_CHECK_VALUE(type == Q8_0 || type == Q4_0 || type == Q4_1,
                    "type must be Q8_0 (8), Q4_0 (2) or Q4_1 (3), got ", type);
  TORCH_CHECK_VALUE(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x must be [M, K] float32 or bfloat16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t bytes = type == Q8_0 ? 32 : 16;
  TORCH_CHECK_VALUE(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.size(2) == bytes && qs.is_contiguous(),
                    "qs must be contiguous uint8 [N, K / 32, ", bytes, "], got ", qs.sizes());
  TORCH_CHECK_VALUE(x.size(1) == qs.size(1) * QK, "x has K = ", x.size(1), ", the weight ", qs.size(1) * QK);
  TORCH_CHECK_VALUE(d.scalar_type() == at::kHalf && d.is_contiguous() && d.size(0) == qs.size(0) &&
                    d.size(1) == qs.size(1), "d must be contiguous float16 [N, K / 32]");
  if (type == Q4_1)
    TORCH_CHECK_VALUE(mn.scalar_type() == at::kHalf && mn.is_contiguous() && mn.sizes() == d.sizes(),
                      "m must be contiguous float16 [N, K / 32] for Q4_1");
}

template <int64_t TYPE>
static void run(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                const at::Tensor& mn, bool int8_activations, float* y) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / QK;
  const int64_t BYTES = TYPE == Q8_0 ? 32 : 16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<int8_t> xq;
  std::vector<float> xd, xsum;
  if (int8_activations) {     // once per call, before the threads split the rows
    xq.resize(M * K);
    xd.resize(M * nb);
    xsum.resize(M * nb);
    for (int64_t m = 0; m < M; ++m)
      quantize_row_q8(xp + m * K, K, xq.data() + m * K, xd.data() + m * nb, xsum.data() + m * nb);
  }
  const uint8_t* wq = qs.data_ptr<uint8_t>();
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* wm = TYPE == Q4_1 ? reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()) : nullptr;
  std::vector<int32_t> xc;
#ifdef LLMOPT_VNNI512
  if (int8_activations && TYPE == Q8_0) {  // gguf_vnni.h: signed codes run as codes + bias, minus this
    xc.resize(M * K / 4);
    const int32_t bias = vnni::code_bias(TYPE);
    for (int64_t i = 0; i < M * K / 4; ++i)
      xc[i] = -bias * (int32_t(xq[4 * i]) + xq[4 * i + 1] + xq[4 * i + 2] + xq[4 * i + 3]);
  }
#endif
  std::vector<int8_t> xsplit;
  std::vector<int32_t> xsplit_c;
  const int64_t steps = (nb + 3) / 4;
#ifdef LLMOPT_VNNI512
  if (int8_activations && TYPE != Q8_0) {  // gguf_vnni.h's tile_nibbles: x as the nibbles lie
    xsplit.assign(M * steps * 128, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        int8_t* dst = xsplit.data() + m * steps * 128 + (b / 4) * 128 + (b % 4) * 16;
        std::memcpy(dst, xq.data() + m * K + b * QK, 16);
        std::memcpy(dst + 64, xq.data() + m * K + b * QK + 16, 16);
      }
    if (TYPE == Q4_0) {
      xsplit_c.resize(M * steps * 16);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < steps * 16; ++i) {
          const int8_t* lo = xsplit.data() + m * steps * 128 + (i / 16) * 128 + (i % 16) * 4;
          int32_t sum = 0;
          for (int j = 0; j < 4; ++j) sum += lo[j] + lo[64 + j];
          xsplit_c[m * steps * 16 + i] = -vnni::code_bias(TYPE) * sum;
        }
    }
  }
#endif
  std::vector<QuantizedRow> xrows;
  for (int64_t m = 0; int8_activations && m < M; ++m)
    xrows.push_back({xq.data() + m * K, xd.data() + m * nb, xsum.data() + m * nb, xc.empty() ? nullptr : xc.data() + m * K / 4,
                     xsplit.empty() ? nullptr : xsplit.data() + m * steps * 128,
                     xsplit_c.empty() ? nullptr : xsplit_c.data() + m * steps * 16});
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#ifdef LLMOPT_VNNI512
    if (int8_activations && nb % 2 == 0) return vnni_all<TYPE>(wq, wd, wm, nb, N, M, xrows.data(), n0, n1, y);
#endif
    int64_t n = n0;
    if (int8_activations && M == 1 && N * nb * BYTES <= MULTI_ROW_MAX_BYTES) {
      const QuantizedRow x{xq.data(), xd.data(), xsum.data()};
      for (; n + 4 <= n1; n += 4)
        dot_rows_int8<TYPE, 4>(wq + n * nb * BYTES, wd + n * nb, wm ? wm + n * nb : nullptr, nb, nb, x, y + n);
    }
    for (; n < n1; ++n) {
      const uint8_t* w = wq + n * nb * BYTES;
      const uint16_t* dn = wd + n * nb;
      const uint16_t* mnn = wm ? wm + n * nb : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mt = int(std::min<int64_t>(4, M - m0));
        float out[4];
        if (int8_activations) {
          QuantizedRow rows[4];
          for (int i = 0; i < mt; ++i)
            rows[i] = {xq.data() + (m0 + i) * K, xd.data() + (m0 + i) * nb, xsum.data() + (m0 + i) * nb};
          switch (mt) {
            case 1: dot_row_int8<TYPE, 1>(w, dn, mnn, nb, rows, out); break;
            case 2: dot_row_int8<TYPE, 2>(w, dn, mnn, nb, rows, out); break;
            case 3: dot_row_int8<TYPE, 3>(w, dn, mnn, nb, rows, out); break;
            default: dot_row_int8<TYPE, 4>(w, dn, mnn, nb, rows, out);
          }
        } else {
          const float* rows[4];
          for (int i = 0; i < mt; ++i) rows[i] = xp + (m0 + i) * K;
          switch (mt) {
            case 1: dot_row_f32<TYPE, 1>(w, dn, mnn, nb, rows, out); break;
            case 2: dot_row_f32<TYPE, 2>(w, dn, mnn, nb, rows, out); break;
            case 3: dot_row_f32<TYPE, 3>(w, dn, mnn, nb, rows, out); break;
            default: dot_row_f32<TYPE, 4>(w, dn, mnn, nb, rows, out);
          }
        }
        for (int i = 0; i < mt; ++i) y[(m0 + i) * N + n] = out[i];
      }
    }
  });
}

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                          const at::Tensor& mn, int64_t type, bool int8_activations) {
  RECORD_FUNCTION("llmopt::gguf_matmul", std::vector<c10::IValue>());  // a named row in torch.profiler
  check_weight(x, qs, d, mn, type);
  const int64_t M = x.size(0), N = qs.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  if (type == Q8_0) run<Q8_0>(x, qs, d, mn, int8_activations, yp);
  else if (type == Q4_0) run<Q4_0>(x, qs, d, mn, int8_activations, yp);
  else run<Q4_1>(x, qs, d, mn, int8_activations, yp);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The activations as the int8 path sees them: q [M, K] int8, d and s [M, K / 32] fp32.
std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % QK == 0, "x must be [M, K] with K a multiple of 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / QK}, x.options().dtype(at::kFloat));
  auto s = at::empty({M, K / QK}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; ++m)
    quantize_row_q8(xf.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K,
                    d.data_ptr<float>() + m * (K / QK), s.data_ptr<float>() + m * (K / QK));
  return {q, d, s};
}

}  // namespace llmopt
