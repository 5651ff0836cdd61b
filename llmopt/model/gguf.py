"""GGUF, llama.cpp's one-file checkpoint, read into llmopt's decoder.

A GGUF file is a header of key-value metadata (the architecture's shapes, the tokenizer's
vocabulary and merges, the chat template) followed by tensors, most of them block-quantized:
in Q4_1, for example, every 32 weights share one scale and one minimum. Loading one means
three translations, each done here in one place: the metadata becomes a Hugging Face
`config.json` dictionary (so `ModelConfig.from_hf` checks it like any other), the tensor
names become Hugging Face names, and the quantized blocks become float tensors through
`gguf.quants.dequantize` (the `gguf` package is llama.cpp's own Python reader; no
dequantizer is written here). One rearrangement is undone on the way: llama.cpp's converter
permutes the rows of Q and K so that RoPE rotates adjacent pairs (x0, x1), (x2, x3), ...,
where the Hugging Face Llama rotates the two halves of each head (x_i with x_{i + d/2}).

Every failure is a `ValueError` naming the file and what is wrong: not GGUF or truncated,
another architecture, a missing tensor, a tensor type the `gguf` package cannot decode.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
OPTIONAL_LAYER_TENSORS = {  # attention biases, where a llama-architecture model has them
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embedding is tied to the head
}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def find_gguf(folder: Path) -> Path | None:
    """The one GGUF file in a folder (None if there is none; an error if several)."""
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{folder} holds several GGUF files ({', '.join(f.name for f in files)}); "
                         "pass the path of the one to load")
    return files[0] if files else None


@lru_cache(maxsize=4)
def _reader(path: str):
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(path)
    except Exception as e:  # a truncated file fails while the reader maps its tensors
        raise ValueError(f"GGUF file {path} is truncated or corrupt ({type(e).__name__}: {e})") from None


def forget_gguf_readers() -> None:
    """Drop the parsed GGUF headers kept for the next call (and their file maps). What a later
    load needs of a file, its config and where its tensors are, stays (`gguf_tensors`)."""
    _reader.cache_clear()


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file as the loaders need it, without the parsed header: its name, type,
    shape (innermost dimension first, as GGUF lists it) and element count, and where its bytes are;
    `data` maps them from the file (the same array the gguf package's reader gives)."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    path: str
    offset: int
    dtype: np.dtype
    data_shape: tuple[int, ...]

    @property
    def data(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.data_shape)


def _file_key(path: str | Path) -> tuple[str, int, int]:
    """A file's identity for the caches below: a rewritten file is read again."""
    path = os.path.abspath(str(path))
    stat = os.stat(path) if os.path.isfile(path) else None
    return (path, stat.st_size, stat.st_mtime_ns) if stat else (path, -1, -1)


def gguf_tensors(path: str | Path) -> list[GGUFTensor]:
    """The file's tensors, from its header, parsed once per file: a second engine on the same
    file (or a later load) finds them without parsing the header's vocabulary again."""
    return _tensors(_file_key(path))


@lru_cache(maxsize=16)
def _tensors(key: tuple[str, int, int]) -> list[GGUFTensor]:
    return [GGUFTensor(t.name, t.tensor_type, tuple(int(n) for n in t.shape), int(t.n_elements), key[0],
                       int(t.data_offset), t.data.dtype, tuple(t.data.shape)) for t in _reader(key[0]).tensors]


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(path: str | Path) -> dict:
    """The GGUF header as the `config.json` a Hugging Face checkpoint of the model would carry
    (read once per file; each call gets its own copy)."""
    return copy.deepcopy(_hf_config(_file_key(path)))


@lru_cache(maxsize=16)
def _hf_config(key: tuple[str, int, int]) -> dict:
    path = key[0]
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {path}: architecture {arch!r} is not supported; llmopt loads GGUF "
                         f"files of the {', '.join(map(repr, SUPPORTED_GGUF_ARCHITECTURES))} architecture")
    if _field(r, f"{arch}.expert_count", 0):
        raise ValueError(f"GGUF file {path}: a mixture-of-experts {arch} model; llmopt's GGUF loader "
                         "runs dense models only")

    def need(key):
        value = _field(r, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file {path} lacks the metadata key {arch}.{key!s}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    if heads < 1:  # checked here, before head_dim's default divides by it (a ZeroDivisionError)
        raise ValueError(f"GGUF file {path}: {arch}.attention.head_count must be >= 1, got {heads}")
    head_dim = int(_field(r, f"{arch}.attention.key_length", hidden // heads))
    rotated = int(_field(r, f"{arch}.rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise ValueError(f"GGUF file {path}: RoPE rotates {rotated} of {head_dim} dimensions per head "
                         "(partial rotary), which llmopt's Llama decoder does not implement")
    names = {t.name for t in r.tensors}
    vocab = _field(r, f"{arch}.vocab_size")
    if vocab is None:
        tokens = r.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(r, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        # the end of a turn (eot) ends generation too, as llama.cpp stops on it
        "eos_token_id": sorted({int(t) for t in (_field(r, "tokenizer.ggml.eos_token_id"),
                                                 _field(r, "tokenizer.ggml.eot_token_id")) if t is not None}),
        "torch_dtype": "bfloat16",  # what a GPU runs it in (dtype="auto"); the CPU uses float32
    }
    if vocab is None:
        raise ValueError(f"GGUF file {path} has neither {arch}.vocab_size nor a tokenizer vocabulary")
    if "rope_freqs.weight" in names:
        # Llama 3.1 / 3.2's RoPE scaling, as llama.cpp's converter stores it: not its four
        # parameters but what they compute, one divisor per frequency
        factors = next(t for t in r.tensors if t.name == "rope_freqs.weight")
        config["rope_scaling"] = {"rope_type": "freq_factors",
                                  "freq_factors": [float(f) for f in np.asarray(factors.data, np.float32)]}
    scaling = _field(r, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF file {path}: RoPE scaling {scaling!r} is not supported (only 'linear')")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    return config


def tensor_elements(path: str | Path) -> dict[str, int]:
    """Each tensor's element count, from the file's header (no tensor is dequantized)."""
    return {t.name: t.n_elements for t in gguf_tensors(path) if t.name != "rope_freqs.weight"}  # not a weight


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of Q / K rows: per head, its converter interleaves the two
    halves (rows 0..d/2-1 and d/2..d-1) into pairs; this puts each half back together."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf(path: str | Path, config: dict | None = None, skip: set[str] = frozenset()):
    """(Hugging Face name, float tensor) for every tensor the decoder needs, dequantized; the
    GGUF names in `skip` (kept as blocks instead) are checked present but not read."""
    from gguf.quants import dequantize

    path = str(path)
    config = config or gguf_hf_config(path)
    tensors = {t.name: t for t in gguf_tensors(path)}
    expected = dict(GLOBAL_TENSORS)
    if config["tie_word_embeddings"]:
        expected.pop("output.weight")
    for i in range(config["num_hidden_layers"]):
        expected.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in LAYER_TENSORS.items()})
        if config["attention_bias"]:
            expected.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in OPTIONAL_LAYER_TENSORS.items()})
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"GGUF file {path} lacks the tensor {', '.join(missing[:3])}{more}")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for gguf_name, hf_name in expected.items():
        if gguf_name in skip:
            continue
        t = tensors[gguf_name]
        # Q / K rows are regrouped by head below: a wrong row count failed there as a bare torch
        # reshape error naming no tensor (load_weights checks every other shape against the model)
        rope_heads = (heads if gguf_name.endswith(("attn_q.weight", "attn_q.bias")) else
                      kv_heads if gguf_name.endswith(("attn_k.weight", "attn_k.bias")) else None)
        if rope_heads is not None:
            shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists dimensions innermost first
            want = (rope_heads * config["head_dim"], *shape[1:])
            if shape != want:
                raise ValueError(f"GGUF file {path}: tensor {gguf_name!r} has shape {shape}; the header's "
                                 f"{config['model_type']}.* sizes imply {want}")
        try:
            array = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ValueError(f"GGUF file {path}: tensor {gguf_name!r} of type {t.tensor_type.name} cannot "
                             f"be dequantized by the gguf package ({e})") from None
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # an F32 tensor comes straight from the read-only file map
            array = array.copy()
        tensor = torch.from_numpy(array)
        if rope_heads is not None:
            tensor = unpermute_rope_rows(tensor, rope_heads)
        yield hf_name, tensor


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer (with its chat template) that transformers builds from a GGUF's metadata.

    Building it parses a 49K-token vocabulary and its merges (about 6 s on 2 cores), so the
    result is saved once under ~/.cache/llmopt (LLMOPT_CACHE overrides) and read from there
    afterwards, keyed by the file's name, size and modification time."""
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LLMOPT_CACHE", Path.home() / ".cache" / "llmopt")) / "gguf-tokenizers" / key
    if (cache / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:
            pass  # a damaged cache entry: build it again below
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"could not build a tokenizer from GGUF file {path} ({type(e).__name__}: {e})") from None
    # Written beside the entry, then renamed into place: a process reading the cache (another
    # engine starting at the same time) sees a whole entry or none.
    partial = cache.with_name(f".{key}.{os.getpid()}")
    try:
        tok.save_pretrained(str(partial))
        os.replace(partial, cache)
    except OSError:
        pass  # a read-only home (build it each time), or another process's entry got there first
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return tok
