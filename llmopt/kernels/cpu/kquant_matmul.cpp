// y = x @ W^T with W held as GGUF k-quant super-blocks (Q4_K, Q6_K: 256 weights each, the scales
// inside the bytes; kquant_rows.h says how they lie and how a row is multiplied), the arithmetic
// llama.cpp runs on a CPU.
//
// A weight may be several row ranges of different types, stacked: a Q4_K_M file stores attn_q and
// attn_k as Q4_K but attn_v of some layers as Q6_K, and the model multiplies all three at once
// (qkv_proj). Both types take x as the same Q8_K codes, so one call quantizes x once, splits all
// the rows among the threads once, and each thread runs each row by its range's kernel, writing
// straight into y's columns: no dense fallback for the whole fused layer, no second call.
//
// Why int8 activations at decode: as for the 32-weight blocks (gguf_matmul.cpp), a decode step
// reads every weight once, and widening 4- or 6-bit codes to fp32 for FMA costs more instructions
// per weight than the memory takes to deliver them, while maddubs + madd multiply 32 codes by
// int8 x in two instructions. llama.cpp quantizes x per 256 values (Q8_K: d = max / -127, kept as
// fp32, with the sums of each 16 codes) for every k-quant. The float32 path dequantizes in
// registers instead: x unrounded, about twice the instructions.
//
// Threads split the output rows (at::parallel_for); a row streams its super-blocks once, and up to
// 4 rows of x share one decoding of each super-block (more rows of x take further tiles of 4 over
// the same weight row, which stays in L1: 4.5 KB for a Q4_K row of 8,192).
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kquant_rows.h"

namespace llmopt {

// llama.cpp's quantize_row_q8_K_ref, per 256 values of x: max = the value of largest magnitude
// (the first such), iscale = -127 / max, q = round_half_even(x * iscale) (at most 127), d = 1 /
// iscale (fp32, negative where max is positive), and the sums of each 16 codes. Also the sums of
// each 32 (pairs of those), which Q4_K's minimum term multiplies.
void quantize_row_q8_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsums, int16_t* sums32) {
  for (int64_t s = 0; s < K / QK_K; ++s) {
    const float* xs = x + s * QK_K;
    int8_t* qs = q + s * QK_K;
    float amax = 0.0f, mx = 0.0f;
    for (int j = 0; j < QK_K; ++j) amax = std::fabs(xs[j]) > amax ? std::fabs(xs[j]) : amax;  // a NaN is skipped, as there
    for (int j = 0; j < QK_K; ++j)
      if (std::fabs(xs[j]) == amax) { mx = xs[j]; break; }
    if (amax == 0.0f) {
      d[s] = 0.0f;
      std::memset(qs, 0, QK_K);
    } else {
      const float iscale = -127.0f / mx;
#ifdef LLMOPT_AVX2
      // cvtps rounds half to even (the default MXCSR mode); packs saturate, as MIN(127, v) would
      const __m256 vs = _mm256_set1_ps(iscale);
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      for (int j = 0; j < QK_K; j += 32) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + j), vs));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + j + 8), vs));
        const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + j + 16), vs));
        const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + j + 24), vs));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + j), _mm256_permutevar8x32_epi32(packed, order));
      }
#else
      for (int j = 0; j < QK_K; ++j) {
        const int v = int(std::nearbyint(iscale * xs[j]));
        qs[j] = int8_t(v < 127 ? v : 127);
      }
#endif
      d[s] = 1.0f / iscale;
    }
    for (int g = 0; g < QK_K / 16; ++g) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += qs[16 * g + i];
      bsums[s * 16 + g] = int16_t(sum);
    }
    for (int g = 0; g < QK_K / 32; ++g) sums32[s * 8 + g] = int16_t(bsums[s * 16 + 2 * g] + bsums[s * 16 + 2 * g + 1]);
  }
}

namespace {

// A weight's row ranges: rows [row0, row0 + rows) are `type`, their bytes from `bytes` on.
struct Part {
  int64_t type, row0, rows;
  const uint8_t* bytes;
};

// Rows n0..n1 of one part (local row numbers) against all M rows of x, in tiles of up to 4.
template <int64_t TYPE>
void run_rows(const Part& p, int64_t n0, int64_t n1, int64_t nsb, int64_t M, int64_t N, bool int8,
              const std::vector<Q8KRow>& xq, const float* xf, int64_t K, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.bytes + n * nsb * kquant_bytes(TYPE);
    const int64_t col = p.row0 + n;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mt = int(std::min<int64_t>(4, M - m0));
      float out[4];
      if (int8) {
        const Q8KRow* xs = xq.data() + m0;
        switch (mt) {
          case 1: kquant_row_int8<TYPE, 1>(w, nsb, xs, out); break;
          case 2: kquant_row_int8<TYPE, 2>(w, nsb, xs, out); break;
          case 3: kquant_row_int8<TYPE, 3>(w, nsb, xs, out); break;
          default: kquant_row_int8<TYPE, 4>(w, nsb, xs, out);
        }
      } else {
        const float* xs[4];
        for (int i = 0; i < mt; ++i) xs[i] = xf + (m0 + i) * K;
        switch (mt) {
          case 1: kquant_row_f32<TYPE, 1>(w, nsb, xs, out); break;
          case 2: kquant_row_f32<TYPE, 2>(w, nsb, xs, out); break;
          case 3: kquant_row_f32<TYPE, 3>(w, nsb, xs, out); break;
          default: kquant_row_f32<TYPE, 4>(w, nsb, xs, out);
        }
      }
      for (int i = 0; i < mt; ++i) y[(m0 + i) * N + col] = out[i];
    }
  }
}

}  // namespace

// x [M, K] float32 or bfloat16; qs the super-blocks of every part, back to back (any shape,
// contiguous uint8: [N, K / 256, bytes] for a weight of one type); types and rows the parts in
// row order. Returns y [M, sum(rows)] in x's dtype.
at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& qs, const std::vector<int64_t>& types,
                         const std::vector<int64_t>& rows, bool int8_activations) {
  RECORD_FUNCTION("llmopt::kquant_matmul", std::vector<c10::IValue>());  // a named row in torch.profiler
  TORCH_CHECK_VALUE(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x must be [M, K] float32 or bfloat16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), nsb = K / QK_K;
  TORCH_CHECK_VALUE(K % QK_K == 0, "k-quant rows hold whole super-blocks of 256 weights; x has K = ", K);
  TORCH_CHECK_VALUE(qs.scalar_type() == at::kByte && qs.is_contiguous(), "qs must be contiguous uint8");
  TORCH_CHECK_VALUE(!types.empty() && types.size() == rows.size(), "types and rows must name the same parts");
  std::vector<Part> parts;
  int64_t N = 0, offset = 0;
  for (size_t i = 0; i < types.size(); ++i) {
    TORCH_CHECK_VALUE(types[i] == Q4_K || types[i] == Q6_K, "k-quant type must be Q4_K (12) or Q6_K (14), got ",
                      types[i]);
    TORCH_CHECK_VALUE(rows[i] > 0, "a part holds at least one row");
    parts.push_back({types[i], N, rows[i], qs.data_ptr<uint8_t>() + offset});
    N += rows[i];
    offset += rows[i] * nsb * kquant_bytes(types[i]);
  }
  TORCH_CHECK_VALUE(offset == qs.numel(), "x has K = ", K, ": its parts' super-blocks take ", offset,
                    " bytes, qs holds ", qs.numel());
  if (qs.dim() == 3)
    TORCH_CHECK_VALUE(types.size() == 1 && qs.size(0) == N && qs.size(1) == nsb && qs.size(2) == kquant_bytes(types[0]),
                      "qs of one type must be [N, K / 256, ", kquant_bytes(types[0]), "], got ", qs.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  // x as Q8_K once per call, before the threads split the rows
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums, sums32;
  std::vector<Q8KRow> xq;
  if (int8_activations) {
    q.resize(M * K);
    d.resize(M * nsb);
    bsums.resize(M * K / 16);
    sums32.resize(M * K / 32);
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        quantize_row_q8_k(xp + m * K, K, q.data() + m * K, d.data() + m * nsb, bsums.data() + m * K / 16,
                          sums32.data() + m * K / 32);
    });
    for (int64_t m = 0; m < M; ++m)
      xq.push_back({q.data() + m * K, d.data() + m * nsb, bsums.data() + m * K / 16, sums32.data() + m * K / 32});
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (const Part& p : parts) {  // this thread's rows [n0, n1) as they fall in each part
      const int64_t lo = std::max(n0, p.row0) - p.row0, hi = std::min(n1, p.row0 + p.rows) - p.row0;
      if (lo >= hi) continue;
      if (p.type == Q4_K) run_rows<Q4_K>(p, lo, hi, nsb, M, N, int8_activations, xq, xp, K, yp);
      else run_rows<Q6_K>(p, lo, hi, nsb, M, N, int8_activations, xq, xp, K, yp);
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The activations as the int8 path sees them: q [M, K] int8, d [M, K / 256] fp32, bsums [M, K / 16] int16.
std::vector<at::Tensor> quantize_activations_k(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % QK_K == 0, "x must be [M, K] with K a multiple of 256");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / QK_K}, x.options().dtype(at::kFloat));
  auto bsums = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  std::vector<int16_t> sums32(K / 32);
  for (int64_t m = 0; m < M; ++m)
    quantize_row_q8_k(xf.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K, d.data_ptr<float>() + m * (K / QK_K),
                      bsums.data_ptr<int16_t>() + m * (K / 16), sums32.data());
  return {q, d, bsums};
}

}  // namespace llmopt
