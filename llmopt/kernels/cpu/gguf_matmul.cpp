// y = x @ W^T with W held as GGUF Q8_0 / Q4_0 / Q4_1 blocks (32 weights, an fp16 scale d,
// and for Q4_1 an fp16 min m), the arithmetic llama.cpp runs on a CPU. The k-quants (Q4_K, Q6_K:
// super-blocks of 256, their scales inside the bytes) take the same entry point with their ggml
// type and are multiplied by kquant_matmul.cpp.
//
// Why this arithmetic at small M (decode): a step reads every weight once, so the kernel
// must spend fewer cycles per weight than the memory needs to deliver it. On AVX2 multiplying
// int8 by int8 does 32 products per instruction pair (maddubs + madd, gguf_rows.h), with
// AVX512_VNNI 64 per instruction (gguf_vnni.h), where widening the weights to fp32 and using
// FMA does 8, and the widening costs more instructions than the products. So, as
// llama.cpp does, each row of x is quantized per 32 values to int8 (Q8_0: d = amax / 127,
// stored as fp16; for Q4_1 also s = d * sum(q), Q8_1), block dot products are exact int32
// sums, and each block adds sum * d_w * d_x to fp32 accumulators. `gguf_matmul_f32` is the
// other choice, the weights dequantized in registers times fp32 x: no rounding of x at all,
// about twice the instructions.
//
// Without AVX512_VNNI, rows of an even number of blocks take gguf_rows_avx2.h's kernels: Q4 blocks
// two a load, eight blocks' scales at once, the weight bytes prefetched ahead.
//
// Threads split the output rows (at::parallel_for). Up to 4 rows of x share one decoding
// of a weight block, and a weight row (a few hundred bytes) stays in L1 while further
// tiles of x run over it; past a few dozen rows a dense fp32 matmul wins on AVX2, not against
// VNNI (llmopt/layers/quant/gguf_linear.py decides).
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstring>
#include <vector>

#include "common.h"
#include "gguf_rows_avx2.h"
#include "gguf_rows.h"
#include "gguf_vnni.h"
#include "kquant_rows.h"

namespace llmopt {

// The one-block loop (rows of an odd number of blocks without AVX512_VNNI; every row without AVX2)
// takes 4 weight rows at a time at decode only while the weight stays in cache, where it is faster
// (SmolLM2's 3072 x 576 Q8_0 at 1 row of x). A weight streamed from memory runs slower that way
// (the 49152 x 576 head), its four interleaved streams defeating the prefetcher, so from this size
// on rows go one at a time. (measured: benchmarks/README.md, "Measurements behind the code's choices")
constexpr int64_t MULTI_ROW_MAX_BYTES = 8 << 20;

// Every call quantizes its x before the threads split the rows, so at one row of x this serial
// loop is part of each matmul's fixed cost: with AVX-512 a block is two vectors (the same IEEE
// operations, so the same bytes as the scalar loop; a NaN is skipped by the max as by fmax).
// sum_out (optional): each block's sum of codes as an integer (s_out holds it scaled and rounded).
void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d_out, float* s_out, int32_t* sum_out = nullptr) {
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
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
    d_out[b] = round_to_fp16(d);
    s_out[b] = round_to_fp16(d * float(sum));
    if (sum_out) sum_out[b] = sum;
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
    if (sum_out) sum_out[b] = sum;
#endif
  }
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
// One row of x takes one weight row at a time: faster than 4 (or 8) rows a tile on SmolLM2's Q4_1
// layers and Q8_0 head (measured: benchmarks/README.md, "Measurements behind the code's choices").
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

#if defined(LLMOPT_AVX2) && !defined(LLMOPT_VNNI512)
// Weight rows n0..n1 against all M rows of x in passes of 4 (gguf_rows_avx2.h: Q4 blocks two at a
// time, Q8_0 one); every size of weight one row at a time, one sequential stream for the prefetchers.
template <int64_t TYPE>
static void avx2_all(const uint8_t* wq, const uint16_t* wd, const uint16_t* wm, int64_t nb, int64_t N, int64_t M,
                      const QuantizedRow* xs, int64_t n0, int64_t n1, float* y) {
  constexpr int64_t BYTES = TYPE == Q8_0 ? 32 : 16;
  float out[4];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = wq + n * nb * BYTES;
    const uint16_t* dn = wd + n * nb;
    const uint16_t* mnn = wm ? wm + n * nb : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mt = int(std::min<int64_t>(4, M - m0));
      switch (mt) {
        case 1: avx2rows::dot_row<TYPE, 1>(w, dn, mnn, nb, xs + m0, out); break;
        case 2: avx2rows::dot_row<TYPE, 2>(w, dn, mnn, nb, xs + m0, out); break;
        case 3: avx2rows::dot_row<TYPE, 3>(w, dn, mnn, nb, xs + m0, out); break;
        default: avx2rows::dot_row<TYPE, 4>(w, dn, mnn, nb, xs + m0, out);
      }
      for (int i = 0; i < mt; ++i) y[(m0 + i) * N + n] = out[i];
    }
  }
}
#endif

static void check_weight(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                         const at::Tensor& mn, int64_t type) {
  TORCH_CHECK_VALUE(type == Q8_0 || type == Q4_0 || type == Q4_1,
                    "type must be Q8_0 (8), Q4_0 (2), Q4_1 (3), Q4_K (12) or Q6_K (14), got ", type);
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
  const uint8_t* wq = qs.data_ptr<uint8_t>();
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* wm = TYPE == Q4_1 ? reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()) : nullptr;
  // x rounded to int8 once per call, before the threads split the weight rows (a prompt's
  // hundreds of rows split among the threads here too; one row runs on the calling thread).
  std::vector<int8_t> xq, xsplit;
  std::vector<float> xd, xsum;
  std::vector<int32_t> xc, xsplit_c, xpairs_c;
  const int64_t steps = (nb + 3) / 4;
#if defined(LLMOPT_AVX2) && !defined(LLMOPT_VNNI512)
  // gguf_rows_avx2.h's rows where K / 32 is even; for Q4 blocks two a load, x laid out to match
  const bool by_avx2_rows = int8_activations && nb % 2 == 0;
#else
  const bool by_avx2_rows = false;
#endif
  std::vector<int8_t> xpairs(by_avx2_rows && TYPE != Q8_0 ? M * K : 0);
  if (by_avx2_rows && TYPE == Q4_0) xpairs_c.resize(M * nb * 4);
  if (int8_activations) {
    xq.resize(M * K);
    xd.resize(M * nb);
    xsum.resize(M * nb);
#ifdef LLMOPT_VNNI512
    if (TYPE == Q8_0) xc.resize(M * K / 4);  // gguf_vnni.h: signed codes run as codes + bias, minus this
    else xsplit.assign(M * steps * 128, 0);  // gguf_vnni.h's tile_nibbles: x as the nibbles lie
    if (TYPE == Q4_0) xsplit_c.resize(M * steps * 16);
#endif
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        int8_t* q = xq.data() + m * K;
        quantize_row_q8(xp + m * K, K, q, xd.data() + m * nb, xsum.data() + m * nb);
#if defined(LLMOPT_AVX2) && !defined(LLMOPT_VNNI512)
        if (!xpairs.empty())
          avx2rows::make_pairs(q, nb, xpairs.data() + m * K, xpairs_c.empty() ? nullptr : xpairs_c.data() + m * nb * 4);
#endif
#ifdef LLMOPT_VNNI512
        constexpr int32_t bias = vnni::code_bias(TYPE);
        if constexpr (TYPE == Q8_0) {
          for (int64_t i = 0; i < K / 4; ++i)
            xc[m * K / 4 + i] = -bias * (int32_t(q[4 * i]) + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
        } else {
          int8_t* split = xsplit.data() + m * steps * 128;
          for (int64_t b = 0; b < nb; ++b) {
            int8_t* dst = split + (b / 4) * 128 + (b % 4) * 16;
            std::memcpy(dst, q + b * QK, 16);
            std::memcpy(dst + 64, q + b * QK + 16, 16);
          }
          for (int64_t i = 0; TYPE == Q4_0 && i < steps * 16; ++i) {
            const int8_t* lo = split + (i / 16) * 128 + (i % 16) * 4;
            int32_t sum = 0;
            for (int j = 0; j < 4; ++j) sum += lo[j] + lo[64 + j];
            xsplit_c[m * steps * 16 + i] = -bias * sum;
          }
        }
#endif
      }
    });
  }
  std::vector<QuantizedRow> xrows;
  for (int64_t m = 0; int8_activations && m < M; ++m)
    xrows.push_back({xq.data() + m * K, xd.data() + m * nb, xsum.data() + m * nb, xc.empty() ? nullptr : xc.data() + m * K / 4,
                     xsplit.empty() ? nullptr : xsplit.data() + m * steps * 128,
                     xsplit_c.empty() ? nullptr : xsplit_c.data() + m * steps * 16,
                     xpairs.empty() ? nullptr : xpairs.data() + m * K,
                     xpairs_c.empty() ? nullptr : xpairs_c.data() + m * nb * 4});
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#ifdef LLMOPT_VNNI512
    if (int8_activations && nb % 2 == 0) return vnni_all<TYPE>(wq, wd, wm, nb, N, M, xrows.data(), n0, n1, y);
#endif
#if defined(LLMOPT_AVX2) && !defined(LLMOPT_VNNI512)
    if (by_avx2_rows) return avx2_all<TYPE>(wq, wd, wm, nb, N, M, xrows.data(), n0, n1, y);
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

at::Tensor gguf_matmul_panels(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn,
                              int64_t type);
at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& qs, const std::vector<int64_t>& types,
                         const std::vector<int64_t>& rows, bool int8_activations);

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                          const at::Tensor& mn, int64_t type, bool int8_activations) {
  if (type == Q4_K || type == Q6_K) {  // super-blocks of one type, [N, K / 256, bytes] (kquant_matmul.cpp)
    TORCH_CHECK_VALUE(qs.dim() == 3 && d.numel() == 0 && mn.numel() == 0,
                      "k-quant super-blocks are qs [N, K / 256, bytes] with their scales inside; d and m must be empty");
    return kquant_matmul(x, qs, {type}, {qs.size(0)}, int8_activations);
  }
  if (qs.dim() == 4) {  // the blocks repacked in panels of 16 rows (gguf_panels.cpp)
    TORCH_CHECK_VALUE(int8_activations, "GGUF panels run int8 activations only; float32 ones take the row layout");
    return gguf_matmul_panels(x, qs, d, mn, type);
  }
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
