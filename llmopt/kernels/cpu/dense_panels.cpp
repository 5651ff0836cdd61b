// y = x @ W^T with W bfloat16 in panels of 32 rows, for any number of rows of x (AVX-512).
//
// Why panels: dense_matmul.cpp's row kernel takes one weight row at a time and dots it with each
// row of x, so every (weight row, x row) pair ends in a horizontal sum of 16 lanes, and every
// weight vector is matched with a fresh load of x. At one row of x that is free (memory is the
// limit); at 8 rows it is not, SmolLM2's bf16 linears taking far longer a step than at one, and
// above 8 rows torch's bf16 GEMM (no AMX on that machine) was slower still, a batch of 16 stepping
// several times as long as a batch of 1 where the weights, read once, say about as long
// (benchmarks/results/roofline.md; measured: benchmarks/README.md, "Measurements behind the code's
// choices").
//
// Here W is stored as llama.cpp repacks its weights for the CPU: a panel is 32 consecutive rows,
// laid out pair of columns by pair of columns, [N / 32, K / 2, 2, 16, 2]: for each pair of input
// columns, two vectors of 16 rows with their two values side by side (64 bytes each). A vector's
// 32-bit lanes hold one row's two bf16 values; the low one moved up 16 bits and the high one with
// the low bits cleared are that row's two weights in float32, one instruction each. Multiplied by
// x[m, k] broadcast to every lane, an FMA adds 16 rows' products into 16 float32 lanes that
// already are 16 outputs: no horizontal sums, and one weight load serves every row of x in the
// tile. A panel is one sequential stream, front to back, for the prefetchers.
// (The pairs are what AVX512_BF16's `vdpbf16ps` multiplies in one instruction, twice the products
// of an FMA. This course's Xeon executes it though its CPUID hides it; a tile on it, x kept in bf16,
// was slower on SmolLM2's linears at 8 rows of x than the FMA tile here (measured:
// benchmarks/README.md): not built.)
//
// Tile: R rows of x x the panel's 32 rows, 2 R float32 accumulators. R up to 8 keeps 16
// accumulators, the 4 widened weight vectors and the broadcasts in the 32 registers; more rows
// take further tiles while the panel (K x 64 bytes: 37 KB at K = 576) is still in L1 / L2.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "common.h"

namespace llmopt {

constexpr int64_t PANEL_ROWS = 32;

bool dense_panels_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
namespace {

constexpr int MR = 8;
// Each step asks for the panel's bytes 4 KB ahead: on SmolLM2's bf16 linears and head the fastest
// distance tried, at one row of x and at eight, and well ahead of no prefetch (the row kernel's
// 16 KB suits its one-row streams, not these).
// (measured: benchmarks/README.md, "Measurements behind the code's choices")
#ifndef LLMOPT_PANEL_PREFETCH
#define LLMOPT_PANEL_PREFETCH 4096
#endif

// 16 float32 -> 16 bf16 at p, rounded to nearest even (common.h's float_to_bf16, 16 at a time).
inline void store_bf16(at::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);  // NaN stays NaN (quiet)
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// Rows of x (float32 [R, K]) against one panel: y[m, 0 .. 32] (row stride N) in bf16, rounded to
// nearest even as torch rounds. With one row of x there would be only two accumulator chains,
// each waiting on its previous FMA; U = 2 gives the odd columns their own accumulators, so four
// chains are in flight, summed at the end.
template <int R, int U>
void tile(const float* x, int64_t K, const at::BFloat16* panel, at::BFloat16* y, int64_t N) {
  __m512 acc[U][R][2];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < R; ++m) acc[u][m][0] = acc[u][m][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t k = 0; k < K; k += 2) {
    const char* ahead = reinterpret_cast<const char*>(panel + k * 32) + LLMOPT_PANEL_PREFETCH;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    __m512 w[2][2];  // [rows 0-15 / 16-31][column k / k + 1], in float32
    for (int v = 0; v < 2; ++v) {
      const __m512i pair = _mm512_loadu_si512(panel + k * 32 + v * 32);
      w[v][0] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      w[v][1] = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
    }
    for (int m = 0; m < R; ++m)
      for (int t = 0; t < 2; ++t) {
        const __m512 xb = _mm512_set1_ps(x[m * K + k + t]);
        const int u = U == 2 ? t : 0;
        acc[u][m][0] = _mm512_fmadd_ps(w[0][t], xb, acc[u][m][0]);
        acc[u][m][1] = _mm512_fmadd_ps(w[1][t], xb, acc[u][m][1]);
      }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < 2; ++v) {
      __m512 s = acc[0][m][v];
      if (U == 2) s = _mm512_add_ps(s, acc[U - 1][m][v]);
      store_bf16(y + m * N + 16 * v, s);
    }
}

// Rows m0..m0+r of x (r < MR) against one panel.
void tail(int64_t r, const float* x, int64_t K, const at::BFloat16* panel, at::BFloat16* y, int64_t N) {
  switch (r) {
    case 1: tile<1, 2>(x, K, panel, y, N); break;
    case 2: tile<2, 2>(x, K, panel, y, N); break;
    case 3: tile<3, 1>(x, K, panel, y, N); break;
    case 4: tile<4, 1>(x, K, panel, y, N); break;
    case 5: tile<5, 1>(x, K, panel, y, N); break;
    case 6: tile<6, 1>(x, K, panel, y, N); break;
    case 7: tile<7, 1>(x, K, panel, y, N); break;
    default: break;
  }
}

}  // namespace
#endif

// w: bf16 [N / 32, K / 2, 2, 16, 2] as llmopt.kernels.cpu.dense_panels packs it; x bf16 [M, K]
// (widened to float32 once, a few KB).
at::Tensor dense_matmul_panels(const at::Tensor& x, const at::Tensor& w) {
  RECORD_FUNCTION("llmopt::dense_matmul", std::vector<c10::IValue>());
  TORCH_CHECK_VALUE(dense_panels_supported(), "bf16 weight panels need AVX-512, which this build has not");
  TORCH_CHECK_VALUE(w.dim() == 5 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(2) == 2 &&
                    w.size(3) == 16 && w.size(4) == 2,
                    "panel weights must be contiguous bfloat16 [N / 32, K / 2, 2, 16, 2], got ", w.sizes());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) == 2 * w.size(1),
                    "x must be bfloat16 [M, ", 2 * w.size(1), "], got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), N = P * PANEL_ROWS;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  const float* xp = xf.data_ptr<float>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Threads split the panels; each panel meets every row of x before the next is read.
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const at::BFloat16* panel = wp + p * K * PANEL_ROWS;
      int64_t m = 0;
      if (M == 1) tile<1, 2>(xp, K, panel, yp + p * PANEL_ROWS, N);
      else
        for (; m + MR <= M; m += MR) tile<MR, 1>(xp + m * K, K, panel, yp + m * N + p * PANEL_ROWS, N);
      if (M > 1 && m < M) tail(M - m, xp + m * K, K, panel, yp + m * N + p * PANEL_ROWS, N);
    }
  });
#endif
  return y;
}

}  // namespace llmopt
