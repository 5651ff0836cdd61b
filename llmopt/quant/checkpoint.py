"""Writing quantized checkpoints in the layouts the hub's tools write, so others can load them.

The folder is a Hugging Face model folder: config.json with a `quantization_config`, one
model.safetensors, and the tokenizer files copied from the source. Tensors keep the
checkpoint names of the source model (q_proj, k_proj, v_proj, gate_proj, up_proj, not
llmopt's fused modules): a fused quantized weight is split back into its shards, each with
its own packed qweight / qzeros / scales (and g_idx, which the shards share). Tensors that
are not quantized (embedding, norms, an untied lm_head, biases) are stored in float16, as
AutoGPTQ and AutoAWQ store them (AWQ's rescaled norm weights keep more precision there
than in bfloat16).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmopt.layers.quant.awq import to_awq
from llmopt.layers.quant.formats import QuantizedWeight
from llmopt.layers.quant.gptq import to_gptq
from llmopt.layers.quant.nf4 import NF4Weight, to_bnb

PACKERS = {"gptq": to_gptq, "awq": to_awq, "bitsandbytes": to_bnb}

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "chat_template.jinja", "generation_config.json")


def checkpoint_shards(model, name: str) -> list[tuple[str, tuple[int, int] | None]]:
    """llmopt module or parameter name -> [(checkpoint name, output rows it holds)]."""
    for fused, part, shard in model.stacked_params:
        if f".{fused}" in name:
            return [(name.replace(fused, p), model.shard_rows(fused, s))
                    for f, p, s in model.stacked_params if f == fused]
    return [(name, None)]


def save_quantized(model, source: Path, out: Path, quantization_config: dict,
                   weights: dict[str, QuantizedWeight | NF4Weight] | None = None, layout: str = "gptq",
                   fp8_modules: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
    """Write `model` to `out` with its linear layers replaced by `weights` (integer methods,
    packed in `layout`) or `fp8_modules` (Fp8Linear per linear); the other tensors in `dtype`."""
    from llmopt.model.gguf import gguf_hf_config, is_gguf

    # a GGUF source has no config.json or tokenizer files: its header stands in for both
    raw = gguf_hf_config(source) if is_gguf(source) else json.loads((source / "config.json").read_text())
    quantized = set(weights or {}) | set(fp8_modules or {})
    tensors: dict[str, torch.Tensor] = {}
    for pname, p in model.named_parameters():
        module_name, _, leaf = pname.rpartition(".")
        if module_name in quantized and leaf == "weight":
            continue  # stored packed, below
        if pname == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for ckpt, rows in checkpoint_shards(model, pname):
            t = p.data if rows is None else p.data[rows[0]:rows[1]]
            tensors[ckpt] = t.to(dtype).contiguous()
    pack = PACKERS.get(layout)   # None for fp8, whose modules write themselves
    for name, w in (weights or {}).items():
        for ckpt, rows in checkpoint_shards(model, name):
            for key, t in pack(w if rows is None else w.rows(*rows)).items():
                tensors[f"{ckpt}.{key}"] = t
    for name, m in (fp8_modules or {}).items():
        for ckpt, rows in checkpoint_shards(model, name):
            a, b = rows or (0, m.out_features)
            tensors[f"{ckpt}.weight"] = m.weight.data[a:b].contiguous()
            tensors[f"{ckpt}.weight_scale"] = m.weight_scale.data[a:b].contiguous()

    out.mkdir(parents=True, exist_ok=True)
    # each tensor its own copy: shards share g_idx in memory, but every shard stores its own
    save_file({k: v.cpu().clone() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    raw["quantization_config"] = quantization_config
    raw["tie_word_embeddings"] = model.config.tie_word_embeddings   # a rotation unties the head
    raw["dtype"] = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    raw.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if is_gguf(source):
        from llmopt.model.loader import load_tokenizer

        load_tokenizer(source).save_pretrained(str(out))
        return
    for f in COPIED_FILES:
        if (source / f).is_file() and source.resolve() != out.resolve():
            shutil.copy(source / f, out / f)


def linear_bytes(model, weights: dict[str, QuantizedWeight | NF4Weight] | None = None, layout: str = "gptq",
                 fp8_modules: dict | None = None) -> tuple[int, int]:
    """(bytes of the stored linear weights, bytes the same weights take in fp16), as written:
    packed integers, scales, zeros and g_idx, or fp8 weights and their scales."""
    stored = fp16 = 0
    pack = PACKERS.get(layout)
    for name in model.quantizable_linears():
        w = model.get_submodule(name).weight
        fp16 += w.numel() * 2
        if weights and name in weights:
            stored += sum(t.numel() * t.element_size() for ckpt, rows in checkpoint_shards(model, name)
                          for t in pack(weights[name] if rows is None else weights[name].rows(*rows)).values())
        elif fp8_modules and name in fp8_modules:
            stored += fp8_modules[name].weight_bytes()
        else:
            stored += w.numel() * 2
    return stored, fp16
