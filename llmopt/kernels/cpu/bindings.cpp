// The Python face of the CPU kernels (built by llmopt/kernels/cpu/__init__.py). Only pybind11 and
// torch's tensor casters: <torch/extension.h> adds the whole C++ frontend, and took this file's build
// from 18 s to 44 s.
#include <torch/csrc/utils/pybind.h>

#include "decode_step.h"
#include "int_kv.h"

namespace llmopt {
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                          const at::Tensor& mn, int64_t type, bool int8_activations);
bool gguf_panels_supported();
std::vector<at::Tensor> quantize_activations(const at::Tensor& x);
at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& qs, const std::vector<int64_t>& types,
                            const std::vector<int64_t>& rows, bool int8_activations);
std::vector<at::Tensor> quantize_activations_k(const at::Tensor& x);
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w);
bool dense_panels_supported();
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& block_table, const at::Tensor& query_start_loc,
                              const at::Tensor& seq_lens, double scale, int64_t window,
                              double k_scale, double v_scale, const at::Tensor& tree_bits, bool invariant,
                              const at::Tensor& k_scales, const at::Tensor& v_scales);
}  // namespace llmopt

// Every kernel lets go of the GIL while it runs (as torch's own ops do): the server's engine thread
// runs steps while its event loop streams tokens, and a notebook's prefill runs beside its client.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &llmopt::gguf_matmul, NoGil(), "y = x @ W^T, W as GGUF Q8_0 / Q4_0 / Q4_1 blocks (rows, or panels of 16 rows) or Q4_K / Q6_K super-blocks");
  m.def("kquant_matmul", &llmopt::kquant_matmul, NoGil(), "y = x @ W^T, W as GGUF k-quant super-blocks: row ranges (types, rows) of Q4_K / Q6_K, back to back in qs");
  m.def("quantize_activations_k", &llmopt::quantize_activations_k, NoGil(), "x per 256 values to int8 (Q8_K): q, d, bsums");
  m.def("gguf_panels_supported", &llmopt::gguf_panels_supported, "whether this build runs GGUF panels (AVX512_VNNI)");
  m.def("dense_matmul", &llmopt::dense_matmul, NoGil(), "y = x @ W^T, W dense bf16 or fp32 [N, K] (a few rows of x) or bf16 panels [N / 32, K / 2, 2, 16, 2] (any), summed in float32, returned in x's dtype");
  m.def("dense_panels_supported", &llmopt::dense_panels_supported, "whether this build runs bf16 weight panels (AVX-512)");
  m.def("quantize_activations", &llmopt::quantize_activations, NoGil(), "x per 32 values to int8 (Q8_0 / Q8_1)");
  m.def("paged_attention", &llmopt::paged_attention, NoGil(), "paged attention over the block pool (invariant: each row's "
        "arithmetic independent of the rest of the batch)");
  // One decoder layer's weights and pool, named (decode_step.h); an empty bias tensor means none.
  py::class_<llmopt::Linear>(m, "Linear")
      .def(py::init([](int64_t kind, at::Tensor w, at::Tensor qs, at::Tensor d, at::Tensor mn, at::Tensor bias,
                       bool int8, int64_t max_rows, int64_t dense_rows, std::vector<int64_t> part_kinds,
                       std::vector<int64_t> part_rows) {
             return llmopt::Linear{kind, w, qs, d, mn, bias.numel() ? bias : at::Tensor(), int8, max_rows, dense_rows,
                                   part_kinds, part_rows};
           }),
           py::arg("kind"), py::arg("w"), py::arg("qs"), py::arg("d"), py::arg("mn"), py::arg("bias"),
           py::arg("int8"), py::arg("max_rows"), py::arg("dense_rows"),
           py::arg("part_kinds") = std::vector<int64_t>{}, py::arg("part_rows") = std::vector<int64_t>{})
      .def_readonly("kind", &llmopt::Linear::kind);
  py::class_<llmopt::DecoderLayer>(m, "DecoderLayer")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_attention_norm, llmopt::Linear qkv, llmopt::Linear o,
                       llmopt::Linear gate_up, llmopt::Linear down, at::Tensor k_pool, at::Tensor v_pool,
                       double k_scale, double v_scale, int64_t window, at::Tensor k_scales, at::Tensor v_scales) {
             return llmopt::DecoderLayer{input_norm, post_attention_norm, qkv, o, gate_up, down, k_pool, v_pool,
                                         k_scale, v_scale, window, k_scales, v_scales};
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("k_pool"), py::arg("v_pool"), py::arg("k_scale"), py::arg("v_scale"),
           py::arg("window"), py::arg("k_scales"), py::arg("v_scales"));
  // the int8 / int4 pool's write (int_kv.h) on its own, for the tests that hold it to the torch one
  m.def("write_int_kv", [](const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, const at::Tensor& k_pool,
                           const at::Tensor& v_pool, const at::Tensor& k_scales, const at::Tensor& v_scales) {
    TORCH_CHECK_VALUE(k.dim() == 3 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous() &&
                      k.scalar_type() == v.scalar_type() && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                      (k_pool.scalar_type() == at::kChar || k_pool.scalar_type() == at::kByte),
                      "expected k, v [T, Hkv, D] contiguous, int64 slots and int8 / uint8 pools");
    const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
    if (k.scalar_type() == at::kFloat)
      llmopt::intkv::write<float>(k.data_ptr<float>(), v.data_ptr<float>(), H * D, slots.data_ptr<int64_t>(), T,
                                  k_pool, v_pool, k_scales, v_scales, H, D);
    else
      llmopt::intkv::write<at::BFloat16>(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), H * D,
                                         slots.data_ptr<int64_t>(), T, k_pool, v_pool, k_scales, v_scales, H, D);
  }, NoGil(), "new keys and values into an int8 / int4 pool (llmopt/kernels/int_kv_ref.py's write_int_kv)");
  m.def("decode_layers", &llmopt::decode_layers, NoGil(), "every decoder layer of a decode (or verification) step, in one call");
  m.def("simd", []() {
#if defined(__AVX512BF16__)
    return std::string("avx512_bf16");
#elif defined(__AVX512F__)
    return std::string("avx512");
#elif defined(__AVX2__)
    return std::string("avx2");
#else
    return std::string("scalar");
#endif
  });
}
