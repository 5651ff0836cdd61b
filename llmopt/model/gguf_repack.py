"""A GGUF file's quantized blocks kept as stored: `LLM(model=...gguf, quantization="gguf")`.

By default a GGUF file is dequantized when loaded (`llmopt.model.gguf`) and runs as a dense
model. With quantization="gguf" every linear layer whose tensors are Q8_0, Q4_0, Q4_1 (blocks
of 32, llmopt.kernels.cpu.gguf_blocks) or Q4_K, Q6_K (super-blocks of 256,
llmopt.kernels.cpu.kquant_blocks) is rebuilt from the file's own bytes as a `GGUFLinear`
(llmopt.layers.quant.gguf_linear): the same blocks and scales llama.cpp multiplies by, nothing
requantized, so llmopt runs the model llama.cpp runs. A Q4_K_M file, the most common download,
is Q4_K with Q6_K for the output head and some layers' attn_v and ffn_down.

Fused layers stack their tensors by rows (q, k, v; gate, up). The 32-weight types stack only
with their own type; the k-quants stack across types (attn_q and attn_k Q4_K with a Q6_K attn_v,
as Q4_K_M files mix them), each row range run by its own kernel in the same call. A fused layer
whose parts cannot stack (a 32-weight type beside a k-quant, or a type no kernel runs: F16,
Q5_0, ...) stays dense. Q and K rows are put back in Hugging Face's order, a row's blocks moving
with it.

The tied output head (token_embd read backwards, as llama.cpp runs it) is built from the same
blocks, so at batch 1 the 49K x 576 head of SmolLM2 is read as 8 or 4 bits too, and the
embedding lookup dequantizes the rows it is asked for from those blocks (`GGUFEmbedding`).
Loaded so (`llmopt.model.loader`), a GGUF model never holds a float copy of a quantized tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from llmopt.kernels.cpu.gguf_blocks import GGML_TYPES, GGUFBlockWeight
from llmopt.kernels.cpu.kquant_blocks import KQUANT_TYPES, KQuantWeight
from llmopt.layers.quant.gguf_embedding import GGUFEmbedding
from llmopt.layers.quant.gguf_linear import GGUFLinear
from llmopt.model.gguf import gguf_tensors, unpermute_rope_rows

WEIGHT_CLASSES = {**dict.fromkeys(GGML_TYPES, GGUFBlockWeight), **dict.fromkeys(KQUANT_TYPES, KQuantWeight)}


def _unpermute(w: GGUFBlockWeight | KQuantWeight, heads: int) -> GGUFBlockWeight | KQuantWeight:
    """llama.cpp's Q / K row order -> HF's: the permutation moves whole rows, so blocks move along."""
    return w.rows(unpermute_rope_rows(torch.arange(w.out_features), heads))


def _stack(blocks: list) -> GGUFBlockWeight | KQuantWeight | None:
    """The parts of a fused layer as one weight, or None where they cannot be one (see above)."""
    if any(b is None for b in blocks):
        return None
    classes = {type(b) for b in blocks}
    if classes == {KQuantWeight}:
        return KQuantWeight.cat(blocks)
    if classes == {GGUFBlockWeight} and len({b.type_name for b in blocks}) == 1:
        return GGUFBlockWeight.cat(blocks)
    return None


def repack_gguf_linears(model, path: str, activations: str = "int8",
                        consumed: set[str] | None = None) -> dict[str, int]:
    """Swap the model's linears (and the output head) for GGUFLinear layers built from the GGUF
    file's blocks, where their types allow (the model may still be on meta: a swapped layer's dense
    weight never exists); the GGUF names of the tensors they took go into `consumed`, and the
    embedding becomes a `GGUFEmbedding` on the same blocks where the head is tied to it. Returns
    how many layers of each type were swapped
    (a k-quant stack of both types counts as "Q4_K+Q6_K" or "Q6_K+Q4_K", its types in row order)."""
    cfg = model.config
    tensors = {t.name: t for t in gguf_tensors(path)}

    def read(name: str, heads: int | None) -> GGUFBlockWeight | KQuantWeight | None:
        t = tensors[name]
        kind = t.tensor_type.name
        if kind not in WEIGHT_CLASSES:
            return None
        row_len = int(t.shape[0])                           # GGUF shapes run innermost first
        data = np.asarray(t.data).reshape(-1, t.data.shape[-1])
        w = WEIGHT_CLASSES[kind].from_gguf_bytes(data, kind, row_len)
        return w if heads is None else _unpermute(w, heads)

    layers = {"self_attn.qkv_proj": [("attn_q", cfg.num_attention_heads), ("attn_k", cfg.num_key_value_heads),
                                     ("attn_v", None)],
              "self_attn.o_proj": [("attn_output", None)],
              "mlp.gate_up_proj": [("ffn_gate", None), ("ffn_up", None)],
              "mlp.down_proj": [("ffn_down", None)]}
    swapped = dict.fromkeys(WEIGHT_CLASSES, 0)
    todo = [(f"model.layers.{i}.{name}", [(f"blk.{i}.{g}.weight", h) for g, h in parts])
            for i in range(cfg.num_hidden_layers) for name, parts in layers.items()]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    todo.append(("lm_head", [(head, None)]))
    for module_name, parts in todo:
        weight = _stack([read(name, heads) for name, heads in parts])
        if weight is None:
            continue
        old = model.get_submodule(module_name)
        bias = getattr(old, "bias", None)
        model.set_submodule(module_name, GGUFLinear(weight, bias, activations))
        swapped[weight.type_name] = swapped.get(weight.type_name, 0) + 1
        if consumed is not None:
            consumed.update(name for name, _ in parts)
    if head == "token_embd.weight" and isinstance(model.lm_head, GGUFLinear):
        dtype = model.model.norm.weight.dtype
        model.model.embed_tokens = GGUFEmbedding(model.lm_head.weight_blocks, dtype)
    return swapped
