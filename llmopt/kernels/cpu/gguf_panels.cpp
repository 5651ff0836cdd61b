// y = x @ W^T with W's GGUF blocks repacked into panels of 16 rows (gguf_panels.h says why and how
// they lie; llmopt/kernels/cpu/gguf_blocks.py packs them). x is rounded per 32 values to int8
// first, as the row-layout kernel's int8 path does (gguf_matmul.cpp), so the two compute the same
// integers; only the order of the float32 additions differs.
//
// Threads split the panels. Within a thread's share each NV panels (a few KB per block row of
// W: the whole panel stays in L1 or L2) meet every MR rows of x in turn, so at a prompt's
// hundreds of rows the weights are read from memory once and x from cache.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "common.h"
#include "gguf_rows.h"
#include "gguf_panels.h"

namespace llmopt {

void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d_out, float* s_out, int32_t* sum_out);  // gguf_matmul.cpp

bool gguf_panels_supported() {
#ifdef LLMOPT_VNNI512
  return true;
#else
  return false;
#endif
}

#ifdef LLMOPT_VNNI512
namespace {

constexpr int MR = 4;  // rows of x per tile
constexpr int NV = 2;  // panels per tile: 4 x 2 int32 and fp32 accumulators, 16 of the 32 vector registers
                      // (6 rows of x measured slower, spilled: benchmarks/README.md)

template <int64_t TYPE, int R>
void tiles(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, const panels::XBlocks& x, int64_t m0,
           int64_t p0, int64_t p1, float* y, int64_t N, int64_t ahead) {
  int64_t p = p0;
  for (; p + NV <= p1; p += NV) panels::tile<TYPE, R, NV>(w, wd, wm, x, m0, p, y, N, ahead);
  for (; p < p1; ++p) panels::tile<TYPE, R, 1>(w, wd, wm, x, m0, p, y, N, ahead);
}

template <int64_t TYPE>
void run(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn, float* y) {
  const int64_t M = x.size(0), K = x.size(1), P = qs.size(0), nb = qs.size(1), N = P * 16;
  constexpr int64_t BYTES = TYPE == Q8_0 ? 32 : 16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  std::vector<int32_t> xc(M * nb);
  constexpr int32_t bias = vnni::code_bias(TYPE);
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int32_t* c = xc.data() + m * nb;  // the blocks' code sums, then -bias times them (unused for Q4_1)
      quantize_row_q8(xp + m * K, K, xq.data() + m * K, xd.data() + m * nb, xs.data() + m * nb, c);
      for (int64_t b = 0; bias != 0 && b < nb; ++b) c[b] *= -bias;
    }
  });
  const panels::XBlocks xb{xq.data(), xd.data(), xs.data(), xc.data(), K, nb};
  const uint8_t* wq = qs.data_ptr<uint8_t>();
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* wm = TYPE == Q4_1 ? reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()) : nullptr;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t pp = p0; pp < p1; pp += 2 * NV) {    // a few panels at a time meet all of x
      const int64_t pe = std::min(p1, pp + 2 * NV);
      // The next group's same block is fetched into L2 meanwhile, so that the first row tile's reads
      // from memory overlap the other tiles' arithmetic: a clear gain on SmolLM2's layers at 16 rows
      // of x, in Q8_0 and Q4_1; at 1 row, where there is no arithmetic to hide behind, within the
      // noise (measured: benchmarks/README.md, "Measurements behind the code's choices").
      const int64_t ahead = pe < p1 ? 2 * NV * nb * 16 * BYTES : 0;
      int64_t m0 = 0;
      for (; m0 + MR <= M; m0 += MR) tiles<TYPE, MR>(wq, wd, wm, xb, m0, pp, pe, y, N, ahead);
      switch (M - m0) {
        case 1: tiles<TYPE, 1>(wq, wd, wm, xb, m0, pp, pe, y, N, ahead); break;
        case 2: tiles<TYPE, 2>(wq, wd, wm, xb, m0, pp, pe, y, N, ahead); break;
        case 3: tiles<TYPE, 3>(wq, wd, wm, xb, m0, pp, pe, y, N, ahead); break;
        default: break;
      }
    }
  });
}

}  // namespace
#endif

// qs uint8 [N / 16, K / 32, 16, 32 or 16] and d (m for Q4_1) fp16 [N / 16, K / 32, 16], as
// GGUFBlockWeight.panels() packs them; int8 activations only.
at::Tensor gguf_matmul_panels(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn,
                              int64_t type) {
  RECORD_FUNCTION("llmopt::gguf_matmul", std::vector<c10::IValue>());
  TORCH_CHECK_VALUE(gguf_panels_supported(), "GGUF panels need AVX512_VNNI, which this build has not");
  TORCH_CHECK_VALUE(type == Q8_0 || type == Q4_0 || type == Q4_1, "type must be Q8_0 (8), Q4_0 (2) or Q4_1 (3), got ", type);
  TORCH_CHECK_VALUE(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x must be [M, K] float32 or bfloat16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t bytes = type == Q8_0 ? 32 : 16;
  TORCH_CHECK_VALUE(qs.dim() == 4 && qs.scalar_type() == at::kByte && qs.size(2) == 16 && qs.size(3) == bytes &&
                    qs.is_contiguous(), "panel qs must be contiguous uint8 [N / 16, K / 32, 16, ", bytes, "], got ", qs.sizes());
  TORCH_CHECK_VALUE(x.size(1) == qs.size(1) * QK, "x has K = ", x.size(1), ", the weight ", qs.size(1) * QK);
  TORCH_CHECK_VALUE(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 3 && d.size(0) == qs.size(0) &&
                    d.size(1) == qs.size(1) && d.size(2) == 16, "panel d must be contiguous float16 [N / 16, K / 32, 16]");
  if (type == Q4_1)
    TORCH_CHECK_VALUE(mn.scalar_type() == at::kHalf && mn.is_contiguous() && mn.sizes() == d.sizes(),
                      "panel m must be contiguous float16 [N / 16, K / 32, 16] for Q4_1");
  at::Tensor y = at::empty({x.size(0), qs.size(0) * 16}, x.options().dtype(at::kFloat));
#ifdef LLMOPT_VNNI512
  if (type == Q8_0) run<Q8_0>(x, qs, d, mn, y.data_ptr<float>());
  else if (type == Q4_0) run<Q4_0>(x, qs, d, mn, y.data_ptr<float>());
  else run<Q4_1>(x, qs, d, mn, y.data_ptr<float>());
#endif
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace llmopt
