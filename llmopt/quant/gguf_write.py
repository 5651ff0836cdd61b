"""Write a model as a GGUF file, llama.cpp's format: `llmopt quantize --method gguf --qtype Q4_K_M`.

The inverse of `llmopt.model.gguf`: Hugging Face tensor names become GGUF names, the Q and K
rows are permuted back to llama.cpp's order (RoPE on adjacent pairs), the config becomes
`llama.*` metadata, and the tokenizer (vocabulary, merges, special ids, chat template)
travels in the header, so llama.cpp or llmopt can run the file alone.

Tensor types per `qtype` (norms and other 1-D tensors stay F32, as llama.cpp keeps them):

    F16, BF16, Q8_0, Q4_0, Q4_1   every 2-D weight in that type (the `gguf` package's
                                  quantizers; the block layouts are its)
    Q4_K_M                        Q4_K (llmopt.quant.kquants), with llama.cpp's mix: Q6_K
                                  for the output head (a tied embedding is the head) and for
                                  attn_v / ffn_down in the first and last eighth of the layers
                                  and every third in between

Llama 3's RoPE scaling travels as llama.cpp's converter writes it, `rope_freqs.weight` (one
factor per frequency). With load_format="dummy" the weights are random and written straight in
their type (`DummyBlocks`), one tensor at a time: an 8B shape's file without 32 GB of floats.

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
               progress: bool = False, load_format: str = "auto", seed: int = 0) -> GGUFResult:
    """Read a full-precision model (bundled name, Hugging Face folder or GGUF file) and write
    it to `out` as one GGUF file of `qtype`. With load_format="dummy" the model is a shape's
    config alone (`llama-3.2-1b`, ...) and its weights are random (`DummyBlocks`): a file for
    measuring speed, at any size, written without ever holding the model in memory."""
    import gguf

    from llmopt.model.config import ModelConfig
    from llmopt.model.gguf import is_gguf, iter_gguf
    from llmopt.model.loader import iter_checkpoint, safetensors_files
    from llmopt.model.registry import has_weights, resolve_model, tokenizer_folder

    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    if out is None or not str(out).endswith(".gguf"):
        raise ValueError(f"out must name a .gguf file to write, got {out!r}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' (the model's weights) or 'dummy' (random weights of "
                         f"its shape), got {load_format!r}")
    t0 = time.perf_counter()
    folder = resolve_model(model)
    cfg = ModelConfig.from_pretrained(folder)
    dummy = load_format == "dummy"
    if not dummy and not has_weights(folder):
        raise ValueError(f"{folder} holds a config.json but no weights (a model's shape); pass "
                         "load_format='dummy' (--load-format dummy) to write random weights of that shape")
    if cfg.architecture != "LlamaForCausalLM" or cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or any(cfg.sliding_windows):
        raise ValueError(f"{folder}: llmopt writes GGUF files of the plain llama architecture, not "
                         f"{cfg.architecture!r} with biases or sliding windows")
    rope_type = (cfg.rope_scaling or {}).get("rope_type")
    if rope_type not in (None, "linear", "llama3", "freq_factors"):
        raise ValueError(f"{folder}: RoPE scaling {rope_type!r} has no GGUF llama metadata that llmopt "
                         "writes (only 'linear', and Llama 3's as per-frequency factors)")
    plan = tensor_plan(cfg, qtype)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_config(writer, cfg, Path(folder).stem if is_gguf(folder) else Path(folder).name, qtype)
    _write_tokenizer(writer, folder if has_weights(folder) else tokenizer_folder(folder), cfg)
    extra = {}
    if rope_type in ("llama3", "freq_factors"):
        extra["rope_freqs.weight"] = rope_freq_factors(cfg)   # what llama.cpp's converter writes
    if dummy:
        source = DummyBlocks(seed)
    else:
        names = {hf: name for name, hf, _, _ in plan}
        weights = iter_gguf(folder) if is_gguf(folder) else iter_checkpoint(safetensors_files(folder))
        held = {names[hf]: t for hf, t in weights if hf in names}
    # The tensors' table goes first, then their data in that order, one tensor in memory at a time.
    for name, factors in extra.items():
        writer.add_tensor_info(name, factors.shape, factors.dtype, factors.nbytes)
    for name, _, shape, kind in plan:
        dtype, nbytes = encoded_layout(shape, kind)
        writer.add_tensor_info(name, encoded_shape(shape, kind), dtype, nbytes,
                               raw_dtype=None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for factors in extra.values():
        writer.write_tensor_data(factors)
    counts: Counter = Counter()
    for name, _, shape, kind in plan:
        if dummy:
            data = source.tensor(name, shape, kind)
        else:
            w = held.pop(name).float().numpy()
            if name.endswith("attn_q.weight"):
                w = permute_rope_rows(w, cfg.num_attention_heads)
            elif name.endswith("attn_k.weight"):
                w = permute_rope_rows(w, cfg.num_key_value_heads)
            data = encode(w, kind)[0]
        writer.write_tensor_data(data)
        counts[kind] += 1
        if progress:
            print(f"  {name:28s} {kind:5s} {tuple(shape)}", flush=True)
    writer.close()
    return GGUFResult(out, qtype, dict(counts), out.stat().st_size, time.perf_counter() - t0)


def tensor_plan(cfg, qtype: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(GGUF name, Hugging Face name, shape as torch has it, GGML type) of every tensor the file
    holds, in llama.cpp's order; the shapes come from the config alone."""
    from llmopt.model.gguf import GLOBAL_TENSORS, LAYER_TENSORS

    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q, i = cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
              "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
              "ffn_gate.weight": (i, h), "ffn_up.weight": (i, h), "ffn_down.weight": (h, i)}
    hf = dict(GLOBAL_TENSORS)
    names = [("token_embd.weight", (cfg.vocab_size, h))]
    for layer in range(cfg.num_hidden_layers):
        names += [(f"blk.{layer}.{g}", shapes[g]) for g in LAYER_TENSORS]
        hf.update({f"blk.{layer}.{g}": f"model.layers.{layer}.{n}" for g, n in LAYER_TENSORS.items()})
    names.append(("output_norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        names.append(("output.weight", (cfg.vocab_size, h)))
    # a tied embedding is also the output head, and llama.cpp's mixes type it as the head
    role = {"token_embd.weight": "output.weight"} if cfg.tie_word_embeddings else {}
    return [(n, hf[n], shape, tensor_type(role.get(n, n), shape, qtype, cfg.num_hidden_layers)) for n, shape in names]


def encoded_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The numpy shape of a tensor's bytes as `encode` returns them (uint8 rows for block types)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind in ("F32", "F16"):
        return shape
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return (*shape[:-1], shape[-1] // block * size)


def encoded_layout(shape: tuple[int, ...], kind: str) -> tuple[np.dtype, int]:
    dtype = np.dtype({"F32": np.float32, "F16": np.float16}.get(kind, np.uint8))
    return dtype, int(np.prod(encoded_shape(shape, kind))) * dtype.itemsize


def rope_freq_factors(cfg) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp stores it: per frequency, the factor its scaled
    frequency is divided by (rope_freqs.weight; `llmopt.model.gguf` reads it back)."""
    from llmopt.layers.rotary import inverse_frequencies

    plain = inverse_frequencies(cfg.head_dim, cfg.rope_theta, None)
    scaled = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return (plain / scaled).numpy().astype(np.float32)


class DummyBlocks:
    """Random weights written straight in their GGML type, as `load_format="dummy"` makes them
    in a dtype (llmopt.model.dummy): norms 1, every matrix drawn from normal(0, 0.02) weights.

    Quantizing a billion random floats in numpy would take minutes, so each type quantizes a
    pool of POOL_BLOCKS blocks of such weights once (with the type's own quantizer: real blocks
    of the scale, minima and codes that weights of that spread give) and a tensor is those
    blocks laid end to end from a random start. The pool's block count is prime, so a row starts
    at another place in the pool than the rows before it: the first repeat comes POOL_BLOCKS rows
    on, past the 128,256 rows of Llama 3's head. The bytes then cost one gather to make: an 8B
    file is written at the disk's speed."""

    POOL_BLOCKS = 131_071   # prime (2^17 - 1); F16 / BF16 "blocks" are single weights: F16_POOL of them
    F16_POOL = 1_048_583    # prime

    def __init__(self, seed: int = 0, std: float = 0.02):
        self.rng = np.random.default_rng(seed)
        self.std = std
        self.pools: dict[str, np.ndarray] = {}

    def pool(self, kind: str) -> np.ndarray:
        """[POOL_BLOCKS, bytes per block] encoded blocks of `kind` (one weight a block for F16)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if kind not in self.pools:
            block = 1 if kind == "F16" else GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
            n = self.F16_POOL if block == 1 else self.POOL_BLOCKS
            w = self.rng.standard_normal((n, block), np.float32) * self.std
            if kind == "F16":
                self.pools[kind] = w.astype(np.float16).view(np.uint8)
            else:
                self.pools[kind] = encode(w, kind)[0].reshape(n, -1)
        return self.pools[kind]

    def tensor(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        if len(shape) == 1:
            return np.ones(shape, np.float32)   # the norms' gains, as the dummy model has them
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        pool = self.pool(kind)
        per_block = 1 if kind == "F16" else GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
        rows, blocks = shape[0], shape[1] // per_block
        start = int(self.rng.integers(len(pool)))
        index = (start + np.arange(rows * blocks, dtype=np.int64)) % len(pool)
        data = pool[index].reshape(rows, -1)
        return data.view(np.float16) if kind == "F16" else data


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
    if (cfg.rope_scaling or {}).get("rope_type") == "linear":   # Llama 3's travels as rope_freqs.weight
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
    if max(by_id) >= cfg.vocab_size:  # the file's token list is vocab_size long: merges would name missing tokens
        raise ValueError(f"{path}: the tokenizer's ids run to {max(by_id)}, past the model's vocab_size "
                         f"{cfg.vocab_size}; a GGUF file lists one token per row of the embedding")
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
