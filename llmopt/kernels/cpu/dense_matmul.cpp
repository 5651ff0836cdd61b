// y = x @ W^T for the few rows of a decode step, W a dense bfloat16 or float32 matrix [N, K].
//
// Why not torch's matmul: at one to a few rows a matmul is a matrix-vector product, and all it
// must do is read W once at the memory's speed. torch hands bfloat16 at M = 1 to a general GEMM
// that repacks and blocks for reuse that one row cannot have: on SmolLM2 a bf16 decode step spent
// most of its time in aten::mm and read its weights far below the machine's bandwidth
// (benchmarks/results/roofline.md; measured: benchmarks/README.md, "Measurements behind the code's
// choices"). Here each thread streams its share of W's rows front to back, once, and multiplies
// every row of x against each weight row while it is in registers, the dot products accumulated
// in float32 (as torch accumulates bf16 products).
//
// The arithmetic, by what the CPU has: with AVX512_BF16, `vdpbf16ps` multiplies 32 bf16 pairs
// into 16 float32 sums in one instruction (x must be bf16 too); else bf16 weights are widened to
// float32 in registers (a 16-bit shift) and multiplied by float32 x with FMAs (AVX-512 or AVX2);
// else plain loops. float32 weights take the FMA path as they are.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "common.h"

namespace llmopt {

namespace {

// Rows of x per pass over W (more rows take further passes, each reading W again): 8 where there
// are 32 vector registers (AVX-512: 8 accumulators and the 8 rows of x), 4 with AVX2's 16.
#if defined(__AVX512F__)
constexpr int MT = 8;
#else
constexpr int MT = 4;
#endif

// Each line of W is asked for this many bytes before it is used. A weight row is a few hundred
// bytes, too short for the hardware prefetcher to ramp up on before the thread moves on. 16 KB
// ahead streamed SmolLM2's bf16 weights fastest of the distances tried, at about the rate a plain
// sum over a large buffer reaches, and clearly faster than no prefetch.
// (measured: benchmarks/README.md, "Measurements behind the code's choices")
#ifndef LLMOPT_PREFETCH_BYTES
#define LLMOPT_PREFETCH_BYTES 16384
#endif
template <typename W>
inline void prefetch(const W* p) {
#if defined(__AVX512F__) || defined(LLMOPT_AVX2)
  const char* c = reinterpret_cast<const char*>(p) + LLMOPT_PREFETCH_BYTES;
  _mm_prefetch(c, _MM_HINT_T0);
  _mm_prefetch(c + 64, _MM_HINT_T0);
#endif
}

#if defined(__AVX512F__)
constexpr int LANES = 16;
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const at::BFloat16* p) {  // 16 bf16 -> 16 fp32: the bits moved up 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
#elif defined(LLMOPT_AVX2)
constexpr int LANES = 8;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// How row_dot multiplies: one vector of W against one vector of x into an accumulator.
// FMA: W widened to float32 (bf16 is the top half of a float32), times float32 x.
template <typename W>
struct FMA {
  using X = float;
#if defined(__AVX512F__) || defined(LLMOPT_AVX2)
  using Acc = vfloat;
  static constexpr int STEP = LANES;
  static Acc zero() { return vzero(); }
  static vfloat wload(const W* p) { return vload(p); }
  static vfloat xload(const float* p) { return vload(p); }
  static Acc mac(Acc a, vfloat w, vfloat x) { return vfma(w, x, a); }
  static float sum(Acc a) { return vsum(a); }
#else
  using Acc = float;
  static constexpr int STEP = 1;
  static Acc zero() { return 0.0f; }
  static float wload(const W* p) { return float(*p); }
  static float xload(const float* p) { return *p; }
  static Acc mac(Acc a, float w, float x) { return a + w * x; }
  static float sum(Acc a) { return a; }
#endif
};

#if defined(__AVX512BF16__)
// bf16 x bf16: 32 products an instruction, summed in pairs into 16 float32 lanes.
struct BF16Pairs {
  using X = at::BFloat16;
  using Acc = __m512;
  static constexpr int STEP = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512bh wload(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh xload(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Acc mac(Acc a, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(a, w, x); }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
};
#endif

// out[m] = dot(one row of W, x row m) for mt rows of x (row stride K), mt independent
// accumulator chains; mt is a template argument so that the accumulators are registers.
template <class A, typename W, int mt>
void row_dot(const W* w, const typename A::X* x, int64_t K, float* out) {
  typename A::Acc acc[mt];
  for (int m = 0; m < mt; ++m) acc[m] = A::zero();
  int64_t k = 0;
  for (; k + A::STEP <= K; k += A::STEP) {
    prefetch(w + k);
    const auto wv = A::wload(w + k);
    for (int m = 0; m < mt; ++m) acc[m] = A::mac(acc[m], wv, A::xload(x + m * K + k));
  }
  for (int m = 0; m < mt; ++m) {
    float tail = 0.0f;
    for (int64_t j = k; j < K; ++j) tail += float(w[j]) * float(x[m * K + j]);
    out[m] = A::sum(acc[m]) + tail;
  }
}

// Weight rows n..n1, one at a time, against x rows m0..m0+mt. y is written in x's dtype (a bf16
// result rounded to nearest even, as .to(bfloat16) rounds), so no second pass converts it.
//
// One weight row at a time: on SmolLM2's bf16 weights faster than 4 weight rows a tile at one to
// 8 rows of x, float32 the same or better (measured: benchmarks/README.md, "Measurements behind
// the code's choices"). One row is one sequential stream for the prefetchers; 4 rows are 4
// streams a row apart. (4 rows were chosen earlier on a Xeon, where one chain left the memory
// idle; not re-measured there.)
template <class A, typename W, int mt, typename Y>
void rows(const W* w, const typename A::X* x, int64_t K, int64_t N, int64_t n, int64_t n1, int64_t m0, Y* y) {
  float out[mt];
  for (; n < n1; ++n) {
    row_dot<A, W, mt>(w + n * K, x + m0 * K, K, out);
    for (int m = 0; m < mt; ++m) y[(m0 + m) * N + n] = Y(out[m]);
  }
}

// Threads split W's rows; each reads its share once per MT rows of x.
template <class A, typename W, typename Y>
void run(const W* w, const typename A::X* x, int64_t M, int64_t N, int64_t K, Y* y) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
      switch (std::min<int64_t>(MT, M - m0)) {
        case 1: rows<A, W, 1, Y>(w, x, K, N, n0, n1, m0, y); break;
        case 2: rows<A, W, 2, Y>(w, x, K, N, n0, n1, m0, y); break;
        case 3: rows<A, W, 3, Y>(w, x, K, N, n0, n1, m0, y); break;
        case 4: rows<A, W, 4, Y>(w, x, K, N, n0, n1, m0, y); break;
#if defined(__AVX512F__)
        case 5: rows<A, W, 5, Y>(w, x, K, N, n0, n1, m0, y); break;
        case 6: rows<A, W, 6, Y>(w, x, K, N, n0, n1, m0, y); break;
        case 7: rows<A, W, 7, Y>(w, x, K, N, n0, n1, m0, y); break;
        case 8: rows<A, W, 8, Y>(w, x, K, N, n0, n1, m0, y); break;
#endif
      }
    }
  });
}

}  // namespace

at::Tensor dense_matmul_panels(const at::Tensor& x, const at::Tensor& w);  // dense_panels.cpp

at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w) {
  if (w.dim() == 5) return dense_matmul_panels(x, w);  // bf16 panels of 32 rows
  RECORD_FUNCTION("llmopt::dense_matmul", std::vector<c10::IValue>());  // a named row in torch.profiler
  TORCH_CHECK_VALUE(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
                    "x must be [M, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK_VALUE(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
                    "w must be bfloat16 or float32, got ", w.scalar_type());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                    "x must be bfloat16 or float32, got ", x.scalar_type());
  const at::Tensor wc = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  if (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    run<BF16Pairs>(wc.data_ptr<at::BFloat16>(), xc.data_ptr<at::BFloat16>(), M, N, K, y.data_ptr<at::BFloat16>());
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  auto go = [&](auto* out) {
    if (w.scalar_type() == at::kBFloat16)
      run<FMA<at::BFloat16>>(wc.data_ptr<at::BFloat16>(), xf.data_ptr<float>(), M, N, K, out);
    else
      run<FMA<float>>(wc.data_ptr<float>(), xf.data_ptr<float>(), M, N, K, out);
  };
  if (x.scalar_type() == at::kFloat) go(y.data_ptr<float>());
  else go(y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace llmopt
