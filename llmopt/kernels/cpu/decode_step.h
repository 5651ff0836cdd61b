// One Llama decoder layer as the compiled step holds it: named fields, one struct per layer, built
// once in Python (llmopt/worker/compiled_decode.py, CompiledLayers) and handed over with each step.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace llmopt {

// One linear layer (nn.Linear, or llmopt.layers.quant.gguf_linear's GGUFLinear): kind 0 = a dense
// weight, either bf16 panels [N / 32, K / 2, 2, 16, 2] (dense_panels.cpp, any number of rows) or
// w [N, K], multiplied by dense_matmul.cpp's kernel for up to dense_rows rows of x and by torch's
// matmul above that; else GGUF blocks, multiplied with int8 (llama.cpp's) or float activations for
// up to max_rows rows of x, and by the dense copy w above that: kind 2, 3, 8 the block type of
// blocks (qs, d, mn) (gguf_matmul.cpp); k-quant super-blocks (kquant_matmul.cpp) carry part_kinds
// and part_rows, their row ranges' types (12, 14) and row counts, all ranges' bytes in qs (kind 12 or
// 14 where all are of one type, -1 where they are not). bias is undefined where the layer has none.
struct Linear {
  int64_t kind;
  at::Tensor w, qs, d, mn, bias;
  bool int8;
  int64_t max_rows, dense_rows;
  std::vector<int64_t> part_kinds, part_rows;
};

// LlamaDecoderLayer (llmopt/model/llama.py): its two RMSNorm weights, its four linears, and its
// layer of the paged KV pool with the pool's scales (1.0 for a pool in the model's dtype; an int8 /
// int4 pool's group scales in k_scales / v_scales, empty otherwise: int_kv.h) and the layer's
// sliding window (0: none).
struct DecoderLayer {
  at::Tensor input_norm, post_attention_norm;
  Linear qkv, o, gate_up, down;
  at::Tensor k_pool, v_pool;
  double k_scale, v_scale;
  int64_t window;
  at::Tensor k_scales, v_scales;
};

void decode_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& ssin, const std::vector<DecoderLayer>& layers,
                   const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& qsl,
                   const at::Tensor& seq_lens, const at::Tensor& tree_bits, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, double eps, bool invariant);

}  // namespace llmopt
