"""A GGUF file's Q8_0 / Q4_0 / Q4_1 blocks kept as stored: `LLM(model=...gguf, quantization="gguf")`.

By default a GGUF file is dequantized when loaded (`llmopt.model.gguf`) and runs as a dense
model. With quantization="gguf" every linear layer whose tensors are Q8_0, Q4_0 or Q4_1 is
rebuilt from the file's own blocks as a `GGUFLinear` (llmopt.layers.quant.gguf_linear): the same
32-weight blocks and fp16 scales llama.cpp multiplies by, nothing requantized, so llmopt runs
the model llama.cpp runs. Fused layers stack their tensors' blocks by rows (q, k, v; gate, up);
Q and K rows are put back in Hugging Face's order, block by block.

The tied output head (token_embd read backwards, as llama.cpp runs it) gets its own copy of
the blocks, so at batch 1 the 49K x 576 head of SmolLM2 is read as 8 or 4 bits too; the
embedding lookup keeps the dense table. Other tensor types (F16, k-quants, ...) stay dense.
"""

from __future__ import annotations

import numpy as np

from llmopt.kernels.cpu.gguf_blocks import GGML_TYPES, GGUFBlockWeight
from llmopt.layers.quant.gguf_linear import GGUFLinear
from llmopt.model.gguf import gguf_tensors, unpermute_rope_rows


def _unpermute(w: GGUFBlockWeight, heads: int) -> GGUFBlockWeight:
    """llama.cpp's Q / K row order -> HF's: the permutation moves whole rows, so blocks move along."""
    m = None if w.m is None else unpermute_rope_rows(w.m, heads)
    return GGUFBlockWeight(w.type_name, unpermute_rope_rows(w.qs, heads), unpermute_rope_rows(w.d, heads), m)


def repack_gguf_linears(model, path: str, activations: str = "int8") -> dict[str, int]:
    """Swap the model's linears (and the output head) for GGUFLinear layers built from the GGUF
    file's blocks, where their types allow; returns how many of each block type were swapped."""
    cfg = model.config
    tensors = {t.name: t for t in gguf_tensors(path)}

    def read(name: str, heads: int | None) -> GGUFBlockWeight | None:
        t = tensors[name]
        kind = t.tensor_type.name
        if kind not in GGML_TYPES:
            return None
        row_len = int(t.shape[0])                           # GGUF shapes run innermost first
        w = GGUFBlockWeight.from_gguf_bytes(np.asarray(t.data).reshape(-1, t.data.shape[-1]), kind, row_len)
        return w if heads is None else _unpermute(w, heads)

    layers = {"self_attn.qkv_proj": [("attn_q", cfg.num_attention_heads), ("attn_k", cfg.num_key_value_heads),
                                     ("attn_v", None)],
              "self_attn.o_proj": [("attn_output", None)],
              "mlp.gate_up_proj": [("ffn_gate", None), ("ffn_up", None)],
              "mlp.down_proj": [("ffn_down", None)]}
    swapped = dict.fromkeys(GGML_TYPES, 0)
    todo = [(f"model.layers.{i}.{name}", [(f"blk.{i}.{g}.weight", h) for g, h in parts])
            for i in range(cfg.num_hidden_layers) for name, parts in layers.items()]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    todo.append(("lm_head", [(head, None)]))
    for module_name, parts in todo:
        blocks = [read(name, heads) for name, heads in parts]
        if any(b is None for b in blocks) or len({b.type_name for b in blocks}) != 1:
            continue
        old = model.get_submodule(module_name)
        bias = getattr(old, "bias", None)
        model.set_submodule(module_name, GGUFLinear(GGUFBlockWeight.cat(blocks), bias, activations))
        swapped[blocks[0].type_name] += 1
    return swapped
