// A decode step of a Llama-family decoder in one call: every layer, without coming back to
// Python between operations (llmopt/worker/compiled_decode.py says when and why).
//
// It mirrors llmopt/model/llama.py line for line: `run_layers` is CausalLM.forward's loop over
// LlamaDecoderLayer.forward, its body LlamaAttention.forward and LlamaMLP.forward, for the flat
// batch of new tokens h [T, hidden]:
//   x = rmsnorm(h) ; q, k, v = x @ Wqkv^T ; RoPE(q, k) ; k, v -> their pool slots   (LlamaAttention)
//   h += attention(q over the pool) @ Wo^T
//   x = rmsnorm(h) ; h += (silu(x @ Wg^T) * (x @ Wu^T)) @ Wd^T                        (LlamaMLP)
// The elementwise steps round to the model's dtype where the eager torch path does, so in
// float32 the two compute the same numbers up to the order of a few sums. (No fused
// multiply-adds here: torch rounds a product before adding it, and so does this file.)
#pragma GCC optimize("fp-contract=off")
// ATen's own headers, op by op, as the other kernels include them: <torch/extension.h> (the whole C++
// frontend) made this file's build four times as long.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/sum.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "decode_step.h"
#include "int_kv.h"

namespace llmopt {
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& mn,
                       int64_t type, bool int8_activations);
at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& qs, const std::vector<int64_t>& types,
                         const std::vector<int64_t>& rows, bool int8_activations);
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_table, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window, double k_scale, double v_scale, const at::Tensor& tree_bits,
                           bool invariant, const at::Tensor& k_scales, const at::Tensor& v_scales);

namespace {

at::Tensor apply(const Linear& l, const at::Tensor& x) {
  if (l.kind == 0 && (l.w.dim() == 5 || x.size(0) <= l.dense_rows)) {
    at::Tensor y = dense_matmul(x, l.w);
    return l.bias.defined() ? y.add(l.bias) : y;
  }
  if (l.kind == 0 || x.size(0) > l.max_rows) return at::linear(x, l.w, l.bias);
  at::Tensor y = l.part_kinds.empty() ? gguf_matmul(x, l.qs, l.d, l.mn, l.kind, l.int8)
                                      : kquant_matmul(x, l.qs, l.part_kinds, l.part_rows, l.int8);
  return l.bias.defined() ? y.add(l.bias) : y;
}

// RMSNorm as llmopt/layers/norm.py computes it, bit for bit: in float32, x * rsqrt(mean(x^2) + eps),
// rounded to the model's dtype, times the weight. The one sum goes through ATen's mean (its order
// of additions is the eager path's; another order differs in the last bit, and the GGUF kernels'
// int8 rounding of activations can turn such a bit into a different token); the rest are single
// IEEE operations (x * x, +, 1 / sqrt, *), the same in any loop. Eight ATen calls become one.
template <typename T>
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& w, double eps) {
  const int64_t rows = h.size(0), H = h.size(1);
  TORCH_CHECK_VALUE(w.scalar_type() == h.scalar_type() && w.is_contiguous() && w.numel() == H,
                    "the norm weights must be contiguous [hidden] in the model's dtype");
  at::Tensor sq = at::empty({rows, H}, h.options().dtype(at::kFloat));
  const T* x = h.data_ptr<T>();
  float* q = sq.data_ptr<float>();
  for (int64_t i = 0; i < rows * H; ++i) q[i] = float(x[i]) * float(x[i]);
  // ATen's mean is its sum divided by H (one IEEE division, checked bit for bit); the division
  // here saves mean's second ATen call, 6 of a norm's 10 microseconds.
  const at::Tensor ms = at::sum(sq, -1, true);
  const float* mp = ms.data_ptr<float>();
  const T* wp = w.data_ptr<T>();
  at::Tensor out = at::empty_like(h);
  T* o = out.data_ptr<T>();
  for (int64_t t = 0; t < rows; ++t) {
    const float r = 1.0f / std::sqrt(mp[t] / float(H) + float(eps));
    for (int64_t j = 0; j < H; ++j) o[t * H + j] = T(float(wp[j]) * float(T(float(x[t * H + j]) * r)));
  }
  return out;
}

// SiLU through the ATen kernel the eager MLP calls (F.silu): its exp is Sleef's, not std::exp.
// q * cos + swap_halves(q) * signed_sin, in place, each product rounded as torch rounds it.
template <typename T>
void rope(T* x, const T* cos, const T* ssin, int64_t tokens, int64_t heads, int64_t d, int64_t stride) {
  const int64_t half = d / 2;
  std::vector<float> tmp(d);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + t * stride + h * d;
      const T* c = cos + t * d;
      const T* s = ssin + t * d;
      for (int64_t j = 0; j < d; ++j) {
        const float swapped = float(row[j < half ? j + half : j - half]);
        tmp[j] = float(T(float(T(float(row[j]) * float(c[j]))) + float(T(swapped * float(s[j])))));
      }
      for (int64_t j = 0; j < d; ++j) row[j] = T(tmp[j]);
    }
}

// The new tokens' keys or values into their pool slots: as they are, or a float32 model's rounded
// to a bfloat16 pool (to nearest even, as the eager path's .to(bfloat16) rounds them).
template <typename T>
void write_slots(const T* src, int64_t stride, const at::Tensor& pool, const int64_t* slots, int64_t tokens, int64_t width) {
  if (pool.scalar_type() == c10::CppTypeToScalarType<T>::value) {
    T* dst = pool.data_ptr<T>();
    for (int64_t t = 0; t < tokens; ++t) std::memcpy(dst + slots[t] * width, src + t * stride, width * sizeof(T));
    return;
  }
  uint16_t* dst = reinterpret_cast<uint16_t*>(pool.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < width; ++j) dst[slots[t] * width + j] = float_to_bf16(float(src[t * stride + j]));
}

template <typename T>
void add_into(T* h, const T* y, int64_t n) {
  at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) h[i] = T(float(h[i]) + float(y[i]));
  });
}

template <typename T>
void run_layers(at::Tensor& h, const at::Tensor& cos, const at::Tensor& ssin, const std::vector<DecoderLayer>& layers,
                const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& qsl, const at::Tensor& seq_lens,
                const at::Tensor& tree_bits, int64_t Hq, int64_t Hkv, int64_t D, double eps, bool invariant) {
  const int64_t T_ = h.size(0), H = h.size(1);
  const int64_t q_size = Hq * D, kv_size = Hkv * D;
  const double scale = 1.0 / std::sqrt(double(D));
  for (const DecoderLayer& l : layers) {
    at::Tensor x = rms_norm<T>(h, l.input_norm, eps);
    at::Tensor qkv = apply(l.qkv, x).contiguous();                    // [T, q + 2 kv]
    T* p = qkv.data_ptr<T>();
    const int64_t stride = q_size + 2 * kv_size;
    rope<T>(p, cos.data_ptr<T>(), ssin.data_ptr<T>(), T_, Hq, D, stride);
    rope<T>(p + q_size, cos.data_ptr<T>(), ssin.data_ptr<T>(), T_, Hkv, D, stride);
    if (l.k_scales.defined() && l.k_scales.numel())   // an int8 / int4 pool (int_kv.h)
      intkv::write<T>(p + q_size, p + q_size + kv_size, stride, slots.data_ptr<int64_t>(), T_, l.k_pool, l.v_pool,
                      l.k_scales, l.v_scales, Hkv, D);
    else {
      write_slots<T>(p + q_size, stride, l.k_pool, slots.data_ptr<int64_t>(), T_, kv_size);
      write_slots<T>(p + q_size + kv_size, stride, l.v_pool, slots.data_ptr<int64_t>(), T_, kv_size);
    }
    at::Tensor q = qkv.narrow(1, 0, q_size).contiguous().view({T_, Hq, D});
    at::Tensor attn = paged_attention(q, l.k_pool, l.v_pool, block_table, qsl, seq_lens, scale, l.window,
                                      l.k_scale, l.v_scale, tree_bits, invariant, l.k_scales, l.v_scales);
    at::Tensor o = apply(l.o, attn.view({T_, q_size})).contiguous();
    add_into<T>(h.data_ptr<T>(), o.data_ptr<T>(), T_ * H);
    x = rms_norm<T>(h, l.post_attention_norm, eps);
    at::Tensor gu = apply(l.gate_up, x).contiguous();                 // [T, 2 * intermediate]
    const int64_t inter = gu.size(1) / 2;
    at::Tensor act = at::silu(gu.narrow(1, 0, inter)).contiguous();
    T* a = act.data_ptr<T>();
    const T* up = gu.data_ptr<T>() + inter;
    for (int64_t t = 0; t < T_; ++t)                                  // * up, rounded as torch's mul
      for (int64_t j = 0; j < inter; ++j) a[t * inter + j] = T(float(a[t * inter + j]) * float(up[t * 2 * inter + j]));
    at::Tensor down = apply(l.down, act).contiguous();
    add_into<T>(h.data_ptr<T>(), down.data_ptr<T>(), T_ * H);
  }
}

}  // namespace

// h [T, hidden] (the token embeddings; updated in place to the last layer's output, before the
// final norm). A step may bring several new tokens per sequence (speculative verification: a
// chain of drafts, or a draft tree under `tree_bits`, paged_attention.cpp; empty: causal).
// `invariant`: the attention's batch-invariant mode (paged_attention.cpp); the linears are made
// invariant by how they are handed over (one kernel at every row count, compiled_decode.py).
void decode_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& ssin, const std::vector<DecoderLayer>& layers,
                   const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& qsl,
                   const at::Tensor& seq_lens, const at::Tensor& tree_bits, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, double eps, bool invariant) {
  TORCH_CHECK_VALUE(h.dim() == 2 && h.is_contiguous(), "h must be contiguous [tokens, hidden]");
  TORCH_CHECK_VALUE(h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16,
                    "the compiled decode step runs float32 or bfloat16, got ", h.scalar_type());
  for (const DecoderLayer& l : layers)
    for (const auto* p : {&l.k_pool, &l.v_pool})
      TORCH_CHECK_VALUE((p->scalar_type() == h.scalar_type() || p->scalar_type() == at::kBFloat16 ||
                         (l.k_scales.defined() && l.k_scales.numel() &&
                          (p->scalar_type() == at::kChar || p->scalar_type() == at::kByte))) && p->is_contiguous(),
                        "pools must be contiguous, in the model's dtype or bfloat16, or int8 / int4 with their scales");
  at::Tensor hh = h;
  if (h.scalar_type() == at::kFloat)
    run_layers<float>(hh, cos, ssin, layers, slots, block_table, qsl, seq_lens, tree_bits, num_heads, num_kv_heads,
                      head_dim, eps, invariant);
  else
    run_layers<at::BFloat16>(hh, cos, ssin, layers, slots, block_table, qsl, seq_lens, tree_bits, num_heads,
                             num_kv_heads, head_dim, eps, invariant);
}

}  // namespace llmopt
