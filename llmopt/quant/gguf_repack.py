"""A GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept quantized: `LLM(model=...gguf, quantization="gguf")`.

By default a GGUF file is dequantized when loaded (`llmopt.model.gguf`) and runs as a dense
model. With quantization="gguf" the linear layers whose blocks torch's CPU kernels can run
(`llmopt.layers.cpu_int`) are rebuilt from the file's bytes instead:

    Q4_0  block of 32: d (f16), 32 x 4 bits;       w = d * (q - 8)   -> int4, zero = 0
    Q4_1  block of 32: d, m (f16), 32 x 4 bits;    w = d * q + m     -> int4, zero = m + 8 d
    Q8_0  block of 32: d (f16), 32 x int8;         w = d * q         -> int8, one scale per row

The int4 mappings are exact up to bf16's rounding of d and m (the kernel's scales are in the
activations' dtype). Q8_0 is not: torch's int8 kernel has one scale per output row, not one
per 32 weights, so Q8_0 rows are requantized per row (round to nearest, int8) from their
dequantized values. In both 4-bit layouts a block's byte j holds weight j in its low nibble
and weight j + 16 in its high nibble.

The tied output head (token_embd read backwards, as llama.cpp runs it) gets its own kernel
copy, so at batch 1 the 49K x 576 head of SmolLM2 is read as int8 / int4 too; the embedding
lookup keeps the dense table. Other tensor types (F16, k-quants, ...) stay dense.
"""

from __future__ import annotations

import numpy as np
import torch

from llmopt.layers.cpu_int import KERNEL_DTYPES, Int4Weight, Int8Weight, int4_kernel_fits
from llmopt.layers.linear import KernelLinear
from llmopt.model.gguf import _reader, unpermute_rope_rows

BLOCK = 32
INT4_TYPES = ("Q4_0", "Q4_1")
INT8_TYPES = ("Q8_0",)


def block_integers(data: np.ndarray, type_name: str, row_len: int) -> dict[str, torch.Tensor]:
    """A tensor's raw bytes [rows, bytes per row] -> its integers and per-block scales:
    q [rows, row_len], d [rows, row_len / 32] (and m for Q4_1), as the file stores them."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, row_len // BLOCK, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    out = {"d": torch.from_numpy(d)}
    if type_name == "Q8_0":
        out["q"] = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, row_len))
        return out
    start = 2
    if type_name == "Q4_1":
        out["m"] = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        start = 4
    qs = blocks[..., start:start + 16]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)       # weights 0..15, then 16..31
    out["q"] = torch.from_numpy(q.reshape(rows, row_len).astype(np.int32))
    return out


def _int4_parts(ints: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale [rows, groups], zero [rows, groups]) in the int4 kernel's form."""
    d = ints["d"]
    zero = ints["m"] + 8 * d if "m" in ints else torch.zeros_like(d)
    return ints["q"], d, zero


def _dequantized(ints: dict[str, torch.Tensor]) -> torch.Tensor:
    q = ints["q"].float().view(ints["q"].shape[0], -1, BLOCK)
    if "m" in ints:
        w = q * ints["d"][..., None] + ints["m"][..., None]
    elif ints["q"].dtype == torch.int8:
        w = q * ints["d"][..., None]
    else:
        w = (q - 8) * ints["d"][..., None]
    return w.view(ints["q"].shape)


def kernel_weight(parts: list[tuple[dict, str]], dtype: torch.dtype) -> Int4Weight | Int8Weight | None:
    """One linear (several GGUF tensors stacked by rows for a fused layer) -> a kernel weight,
    or None where the types or the shape do not fit a kernel."""
    types = {t for _, t in parts}
    q_all = torch.cat([ints["q"] for ints, _ in parts])
    n, k = q_all.shape
    if types <= set(INT4_TYPES) and int4_kernel_fits(n, k, BLOCK) is None:
        q, scale, zero = (torch.cat(x) for x in zip(*(_int4_parts(ints) for ints, _ in parts)))
        return Int4Weight(q, scale.t(), zero.t(), dtype)
    if types <= set(INT8_TYPES):
        return Int8Weight.quantize(torch.cat([_dequantized(ints) for ints, _ in parts]), dtype)
    return None


def repack_gguf_linears(model, path: str) -> dict[str, int]:
    """Swap the model's linears (and the output head) for kernel linears built from the GGUF
    file's blocks, where their types allow; returns how many of each kind were swapped."""
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"quantization='gguf' runs the GGUF blocks through torch's CPU int kernels, which "
                         f"take bfloat16 or float16 activations; pass dtype='bfloat16' (got {dtype})")
    cfg = model.config
    tensors = {t.name: t for t in _reader(str(path)).tensors}

    def read(name: str, heads: int | None = None):
        t = tensors[name]
        kind = t.tensor_type.name
        if kind not in INT4_TYPES + INT8_TYPES:
            return None
        row_len = int(t.shape[0])                           # GGUF shapes run innermost first
        ints = block_integers(np.asarray(t.data).reshape(-1, t.data.shape[-1]), kind, row_len)
        if heads is not None:                               # llama.cpp's Q / K row order -> HF's
            ints = {key: unpermute_rope_rows(v, heads) for key, v in ints.items()}
        return ints, kind

    layers = {"self_attn.qkv_proj": [("attn_q", cfg.num_attention_heads), ("attn_k", cfg.num_key_value_heads),
                                     ("attn_v", None)],
              "self_attn.o_proj": [("attn_output", None)],
              "mlp.gate_up_proj": [("ffn_gate", None), ("ffn_up", None)],
              "mlp.down_proj": [("ffn_down", None)]}
    swapped = {"int4": 0, "int8": 0}
    todo = [(f"model.layers.{i}.{name}", [(f"blk.{i}.{g}.weight", h) for g, h in parts])
            for i in range(cfg.num_hidden_layers) for name, parts in layers.items()]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    todo.append(("lm_head", [(head, None)]))
    for module_name, parts in todo:
        read_parts = [read(name, heads) for name, heads in parts]
        if any(p is None for p in read_parts):
            continue
        weight = kernel_weight(read_parts, dtype)
        if weight is None:
            continue
        old = model.get_submodule(module_name)
        bias = getattr(old, "bias", None)
        model.set_submodule(module_name, KernelLinear(weight, None if bias is None else bias.data))
        swapped["int4" if isinstance(weight, Int4Weight) else "int8"] += 1
    return swapped
