"""Write a model as a GGUF file, llama.cpp's format: `llmopt quantize --method gguf --qtype Q4_K_M`.

The inverse of `llmopt.model.gguf`: Hugging Face tensor names become GGUF names, the Q and K
rows are permuted back to llama.cpp's order (RoPE on adjacent pairs), the config becomes
`llama.*` metadata, and the tokenizer (vocabulary, merges, special ids, chat template)
travels in the header, so llama.cpp or llmopt can run the file alone.

Tensor types per `qtype` (norms and other 1-D tensors stay F32, as llama.cpp keeps them):

    F16, BF16, Q8_0, Q4_0, Q4_1   every 2-D weight in that type (the `gguf` package's
                                  quantizers; the block layouts are its)
    Q4_K_M                        Q4_K (llmopt.quant.kquants), with llama.cpp's mix: Q6_K
                                  for the output head and for attn_v / ffn_down in the first
                                  and last eighth of the layers and every third in between

A row whose length is not a multiple of the type's block (256 for k-quants, 32 for the
others) falls back as llama.cpp's quantizer does: Q4_K -> Q5_0, Q6_K -> Q8_0, others -> F16.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QTYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M")


@dataclass
class GGUFResult:
    path: Path
    qtype: str
    tensor_types: dict[str, int]   # GGML type name -> how many tensors
    file_bytes: int
    seconds: float


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(gguf_name: str, shape: tuple[int, ...], qtype: str, n_layers: int) -> str:
    """The GGML type one tensor is written in."""
    if len(shape) == 1:
        return "F32"
    if qtype != "Q4_K_M":
        want = qtype
    elif gguf_name == "output.weight":
        want = "Q6_K"
    elif gguf_name.endswith(("attn_v.weight", "ffn_down.weight")) and \
            use_more_bits(int(gguf_name.split(".")[1]), n_layers):
        want = "Q6_K"
    else:
        want = "Q4_K"
    row = shape[-1]
    if want in ("Q4_K", "Q6_K") and row % 256:
        return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[want]
    if want in ("Q8_0", "Q4_0", "Q4_1") and row % 32:
        return "F16"
    return want


def encode(w: np.ndarray, ggml_type: str):
    """(array, raw GGML type or None) for GGUFWriter.add_tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from llmopt.quant.kquants import quantize_q4_k, quantize_q6_k

    if ggml_type == "F32":
        return w.astype(np.float32), None
    if ggml_type == "F16":
        return w.astype(np.float16), None
    t = GGMLQuantizationType[ggml_type]
    if ggml_type == "Q4_K":
        return quantize_q4_k(w), t
    if ggml_type == "Q6_K":
        return quantize_q6_k(w), t
    return quantize(w.astype(np.float32), t), t


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's half-split Q / K rows -> llama.cpp's interleaved pairs (the inverse of
    `llmopt.model.gguf.unpermute_rope_rows`)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model="tiny", qtype: str = "Q4_K_M", out: str | Path | None = None,
               progress: bool = False) -> GGUFResult:
    """Read a full-precision model (bundled name, Hugging Face folder or GGUF file) and write
    it to `out` as one GGUF file of `qtype`."""
    import gguf

    from llmopt.model.config import ModelConfig
    from llmopt.model.gguf import GLOBAL_TENSORS, LAYER_TENSORS, is_gguf, iter_gguf
    from llmopt.model.loader import iter_checkpoint, safetensors_files
    from llmopt.model.registry import resolve_model

    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    if out is None or not str(out).endswith(".gguf"):
        raise ValueError(f"out must name a .gguf file to write, got {out!r}")
    t0 = time.perf_counter()
    folder = resolve_model(model)
    cfg = ModelConfig.from_pretrained(folder)
    if cfg.architecture != "LlamaForCausalLM" or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or any(cfg.sliding_windows):
        raise ValueError(f"{folder}: llmopt writes GGUF files of the plain llama architecture, not "
                         f"{cfg.architecture!r} with biases or sliding windows")
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") != "linear":
        raise ValueError(f"{folder}: RoPE scaling {cfg.rope_scaling.get('rope_type')!r} has no GGUF "
                         "llama metadata that llmopt writes (only 'linear')")
    names = dict((v, k) for k, v in GLOBAL_TENSORS.items())
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{h}": f"blk.{i}.{g}" for g, h in LAYER_TENSORS.items()})
    weights = iter_gguf(folder) if is_gguf(folder) else iter_checkpoint(safetensors_files(folder))

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_config(writer, cfg, Path(folder).stem if is_gguf(folder) else Path(folder).name, qtype)
    _write_tokenizer(writer, folder, cfg)
    counts: Counter = Counter()
    for hf_name, tensor in weights:
        name = names.get(hf_name)
        if name is None or (name == "output.weight" and cfg.tie_word_embeddings):
            continue
        w = tensor.float().numpy()
        if name.endswith("attn_q.weight"):
            w = permute_rope_rows(w, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = permute_rope_rows(w, cfg.num_key_value_heads)
        kind = tensor_type(name, w.shape, qtype, cfg.num_hidden_layers)
        data, raw = encode(w, kind)
        writer.add_tensor(name, data, raw_dtype=raw)
        counts[kind] += 1
        if progress:
            print(f"  {name:28s} {kind:5s} {tuple(w.shape)}", flush=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFResult(out, qtype, dict(counts), out.stat().st_size, time.perf_counter() - t0)


def _write_config(writer, cfg, name: str, qtype: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    ftype = {"F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0",
             "Q4_1": "MOSTLY_Q4_1", "Q4_K_M": "MOSTLY_Q4_K_M"}[qtype]
    writer.add_file_type(gguf.LlamaFileType[ftype].value)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(writer, folder: Path, cfg) -> None:
    """Copy a GGUF source's tokenizer keys; build them from a Hugging Face tokenizer.json."""
    import gguf

    from llmopt.model.gguf import _reader, is_gguf

    if is_gguf(folder):
        for key, field in _reader(str(folder)).fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                writer.add_key_value(key, field.contents(), field.types[0], sub)
        return
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json to write into the GGUF file")
    tj = json.loads(path.read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE" or (tj.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{path}: llmopt writes byte-level BPE tokenizers into GGUF (GPT-2 style); "
                         f"this one is {model.get('type')!r} with pre-tokenizer {tj.get('pre_tokenizer')!r}")
    special = {t["id"]: t["content"] for t in tj.get("added_tokens", [])}
    by_id = {i: tok for tok, i in model["vocab"].items()} | special
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tc_path = Path(folder) / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    ids = {c: model["vocab"].get(c, next((i for i, s in special.items() if s == c), None))
           for c in (tc.get("bos_token"), tc.get("eos_token"), tc.get("pad_token")) if isinstance(c, str)}
    if tc.get("bos_token") in ids:
        writer.add_bos_token_id(ids[tc["bos_token"]])
    if tc.get("eos_token") in ids:
        writer.add_eos_token_id(ids[tc["eos_token"]])
    if tc.get("pad_token") in ids:
        writer.add_pad_token_id(ids[tc["pad_token"]])
    post = json.dumps(tj.get("post_processor") or {})
    writer.add_add_bos_token(tc.get("bos_token") is not None and f'"{tc["bos_token"]}"' in post)
    template = tc.get("chat_template")
    if template is None and (Path(folder) / "chat_template.jinja").is_file():
        template = (Path(folder) / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)
