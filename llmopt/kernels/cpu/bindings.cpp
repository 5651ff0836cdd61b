// The Python face of the CPU kernels (built by llmopt/kernels/cpu/__init__.py).
#include <torch/extension.h>

namespace llmopt {
torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                          const torch::Tensor& mn, int64_t type, bool int8_activations);
bool gguf_panels_supported();
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x);
torch::Tensor dense_matmul(const torch::Tensor& x, const torch::Tensor& w);
bool dense_panels_supported();
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& block_table, const torch::Tensor& query_start_loc,
                              const torch::Tensor& seq_lens, double scale, int64_t window,
                              double k_scale, double v_scale, const at::Tensor& tree_bits);
void decode_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& ssin, const std::vector<at::Tensor>& norms,
                   const std::vector<at::Tensor>& linear_tensors, const std::vector<int64_t>& linear_kinds,
                   bool int8_activations, int64_t kernel_max_rows, int64_t dense_rows,
                   const std::vector<at::Tensor>& k_pools,
                   const std::vector<at::Tensor>& v_pools, const std::vector<double>& k_scales,
                   const std::vector<double>& v_scales, const std::vector<int64_t>& windows, const at::Tensor& slots,
                   const at::Tensor& block_table, const at::Tensor& qsl, const at::Tensor& seq_lens,
                   const at::Tensor& tree_bits, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps);
}  // namespace llmopt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &llmopt::gguf_matmul, "y = x @ W^T, W as GGUF Q8_0 / Q4_0 / Q4_1 blocks (rows, or panels of 16 rows)");
  m.def("gguf_panels_supported", &llmopt::gguf_panels_supported, "whether this build runs GGUF panels (AVX512_VNNI)");
  m.def("dense_matmul", &llmopt::dense_matmul, "y = x @ W^T, W dense bf16 or fp32 [N, K] (a few rows of x) or bf16 panels [N / 32, K / 2, 2, 16, 2] (any), summed in float32, returned in x's dtype");
  m.def("dense_panels_supported", &llmopt::dense_panels_supported, "whether this build runs bf16 weight panels (AVX-512)");
  m.def("quantize_activations", &llmopt::quantize_activations, "x per 32 values to int8 (Q8_0 / Q8_1)");
  m.def("paged_attention", &llmopt::paged_attention, "paged attention over the block pool");
  m.def("decode_layers", &llmopt::decode_layers, "every decoder layer of a decode (or verification) step, in one call");
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
