"""KV-cache memory: how many bytes the cached keys and values of one token take.

Every layer keeps, for every token in the context, one key and one value vector per KV head:

    bytes per token = num_layers x num_kv_heads x head_dim x 2 (K and V) x bytes per element

and a batch needs that times the tokens of every sequence. Multi-head attention (MHA) has
as many KV heads as query heads; grouped-query attention (GQA) shares each KV head among a
group of query heads; multi-query attention (MQA) keeps a single one. Multi-head latent
attention (MLA, DeepSeek-V2/V3) caches one compressed latent per token per layer instead,
kv_lora_rank + qk_rope_head_dim numbers shared by all heads, from which K and V are rebuilt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from numbers import Integral
from pathlib import Path

from llmopt.model.registry import model_path

# Bytes per cached number, by the names vLLM's dtype and kv_cache_dtype options use.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """MHA / GQA / MQA: a key and a value vector per KV head per layer."""
    _check_positive(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype_bytes=dtype_bytes)
    return num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


def mla_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                        dtype_bytes: int = 2) -> int:
    """MLA: one latent (kv_lora_rank) plus the shared RoPE key part per layer; no x2, no heads."""
    _check_positive(num_layers=num_layers, kv_lora_rank=kv_lora_rank, dtype_bytes=dtype_bytes)
    if not isinstance(qk_rope_head_dim, Integral) or qk_rope_head_dim < 0:
        raise ValueError(f"qk_rope_head_dim must be an integer >= 0, got {qk_rope_head_dim!r}")
    return num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes


@dataclass(frozen=True)
class KVSpec:
    """The few numbers of a model's config that decide its KV-cache size."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int                          # width of one key head
    kv_lora_rank: int | None = None        # MLA models only
    qk_rope_head_dim: int | None = None    # MLA models only
    max_position_embeddings: int | None = None
    num_params: float | None = None        # total parameters, to compare KV with weights
    source: str = ""                       # where the numbers come from

    @property
    def attention(self) -> str:
        if self.kv_lora_rank is not None:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def bytes_per_token(self, dtype_bytes: int = 2) -> int:
        if self.kv_lora_rank is not None:
            return mla_bytes_per_token(self.num_layers, self.kv_lora_rank, self.qk_rope_head_dim or 0,
                                       dtype_bytes)
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)

    def cache_bytes(self, num_tokens: int, batch_size: int = 1, dtype_bytes: int = 2) -> int:
        """KV memory of `batch_size` sequences of `num_tokens` tokens each."""
        _check_positive(num_tokens=num_tokens, batch_size=batch_size)
        return self.bytes_per_token(dtype_bytes) * num_tokens * batch_size

    def max_concurrency(self, budget_bytes: int, num_tokens: int, dtype_bytes: int = 2) -> int:
        """How many sequences of `num_tokens` tokens fit in `budget_bytes` of KV memory
        (vLLM logs the same number at startup as "Maximum concurrency")."""
        return int(budget_bytes // self.cache_bytes(num_tokens, 1, dtype_bytes))

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "") -> "KVSpec":
        """Read the numbers from a Hugging Face config.json (Llama, Qwen2, Mistral, DeepSeek...)."""
        heads = int(config["num_attention_heads"])
        mla = config.get("kv_lora_rank") is not None
        return cls(
            name=name or config.get("_name_or_path", "") or config.get("model_type", "model"),
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            # MLA: a key head is its no-RoPE part plus the RoPE part (transformers 5 writes the
            # RoPE part alone as head_dim, so it is not read for MLA)
            head_dim=int(config["qk_nope_head_dim"] + config["qk_rope_head_dim"] if mla
                         else config.get("head_dim") or config["hidden_size"] // heads),
            kv_lora_rank=int(config["kv_lora_rank"]) if mla else None,
            qk_rope_head_dim=int(config.get("qk_rope_head_dim", 0)) if mla else None,
            max_position_embeddings=config.get("max_position_embeddings"),
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path, name: str = "") -> "KVSpec":
        folder = Path(folder)
        return cls.from_hf_config(json.loads((folder / "config.json").read_text()), name or folder.name)


# Shapes from each model's config.json on the Hugging Face hub (the source field).
PRESETS: dict[str, KVSpec] = {s.name: s for s in [
    KVSpec("Llama-2-7B", 32, 32, 32, 128, max_position_embeddings=4096, num_params=6.74e9,
           source="meta-llama/Llama-2-7b-hf"),
    KVSpec("Llama-2-13B", 40, 40, 40, 128, max_position_embeddings=4096, num_params=13.0e9,
           source="meta-llama/Llama-2-13b-hf"),
    KVSpec("Llama-2-70B", 80, 64, 8, 128, max_position_embeddings=4096, num_params=69.0e9,
           source="meta-llama/Llama-2-70b-hf"),
    KVSpec("Llama-3-8B", 32, 32, 8, 128, max_position_embeddings=8192, num_params=8.03e9,
           source="meta-llama/Meta-Llama-3-8B"),
    KVSpec("Llama-3-70B", 80, 64, 8, 128, max_position_embeddings=8192, num_params=70.6e9,
           source="meta-llama/Meta-Llama-3-70B"),
    KVSpec("Llama-3.1-405B", 126, 128, 8, 128, max_position_embeddings=131072, num_params=406e9,
           source="meta-llama/Llama-3.1-405B"),
    KVSpec("Mistral-7B", 32, 32, 8, 128, max_position_embeddings=32768, num_params=7.24e9,
           source="mistralai/Mistral-7B-v0.3"),
    KVSpec("Falcon-7B", 32, 71, 1, 64, max_position_embeddings=2048, num_params=7.22e9,
           source="tiiuae/falcon-7b"),
    # MLA: num_kv_heads and head_dim are those of the attention it replaces (128 heads; a key
    # is 128 + 64 = 192 wide); the cache holds the 512 + 64 latent instead.
    KVSpec("DeepSeek-V3", 61, 128, 128, 192, kv_lora_rank=512, qk_rope_head_dim=64,
           max_position_embeddings=163840, num_params=671e9, source="deepseek-ai/DeepSeek-V3"),
    replace(KVSpec.from_pretrained(model_path("tiny"), "tiny"), source="llmopt's bundled model"),
]}


def format_bytes(n: float) -> str:
    """Decimal units, as in "a 40 GB KV cache" (1 GB = 10**9 bytes; a GiB is 2**30 = 1.074 GB)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n):,} B"


def _check_positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, Integral) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
