"""The model's shape, read from a Hugging Face `config.json`.

One small dataclass holds everything the decoder needs; `from_hf` is the only
place that knows how Llama, Qwen2 and Mistral spell their fields (and how
transformers 4.x and 5.x spell RoPE), so the model code never branches on names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from llmopt.layers.mla import MLAConfig
from llmopt.layers.moe import MoEConfig

# The architectures whose weights map onto llmopt's decoder, and what differs between them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",  # q/k/v projections carry a bias
    "MistralForCausalLM": "mistral",  # sliding-window attention
    "DeepseekV3ForCausalLM": "deepseek_v3",  # MLA + mixture of experts (llmopt/model/deepseek.py)
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")  # the last: a GGUF's rope_freqs
YARN_ARCHITECTURES = ("deepseek_v3",)  # YaRN, tested against transformers for these only


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: list[int | None] = field(default_factory=list)  # one per layer
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    quantization_config: dict | None = None
    mla: MLAConfig | None = None  # DeepSeek: latent attention instead of q/k/v heads
    moe: MoEConfig | None = None  # DeepSeek: routed + shared experts after the dense layers

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "ModelConfig":
        """From a Hugging Face folder's config.json, or from a GGUF file's metadata."""
        from llmopt.model.gguf import gguf_hf_config, is_gguf

        if is_gguf(folder):
            return cls.from_hf(gguf_hf_config(folder), source=str(folder))
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"checkpoint folder {folder} has no config.json; a Hugging Face "
                             "model folder needs config.json and model.safetensors")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # "[[[[..." nested past the stack
            raise ValueError(f"{path} is not valid JSON: {type(e).__name__}: {e}") from None
        if not isinstance(raw, dict):  # a list or a string is JSON too, but not a config
            raise ValueError(f"{path} must hold a JSON object of the model's fields, got {type(raw).__name__}")
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, c: dict, source: str = "config.json") -> "ModelConfig":
        archs = c.get("architectures") or []
        arch = next((a for a in archs if isinstance(a, str) and a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: architecture {archs or c.get('model_type')!r} is not "
                             f"supported; llmopt loads {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        # Every size is checked (an integer in range) before anything divides by it or allocates
        # by it: a zero, negative, NaN or string field failed deep in torch, or loaded a broken model.
        hidden, heads = _int(c, "hidden_size", source), _int(c, "num_attention_heads", source)
        kv_heads = _int(c, "num_key_value_heads", source, default=heads)
        head_dim = _int(c, "head_dim", source, default=hidden // heads)
        if family == "deepseek_v3":  # a query/key head: its no-RoPE part plus its RoPE part
            head_dim = _int(c, "qk_nope_head_dim", source, low=0) + _int(c, "qk_rope_head_dim", source)
        elif head_dim % 2:
            raise ValueError(f"{source}: head_dim must be even (RoPE rotates pairs), got {head_dim}")
        layers = _int(c, "num_hidden_layers", source, high=MAX_LAYERS)
        cfg = cls(
            architecture=arch, vocab_size=_int(c, "vocab_size", source), hidden_size=hidden,
            intermediate_size=_int(c, "intermediate_size", source), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=_int(c, "max_position_embeddings", source, default=2048,
                                         high=MAX_POSITIONS),
            rms_norm_eps=_float(c, "rms_norm_eps", source, 1e-6),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(c.get("attention_bias", False)),
            o_bias=family in ("llama", "deepseek_v3") and bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=_as_list(c.get("eos_token_id"), source),
            torch_dtype=c.get("dtype") or c.get("torch_dtype"),
            quantization_config=c.get("quantization_config"),
        )
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        cfg.rope_theta, cfg.rope_scaling = _rope(c, source, family)
        cfg.sliding_windows = _sliding_windows(c, family, layers, source)
        if family == "deepseek_v3":
            try:
                cfg.mla, cfg.moe = _deepseek(c, cfg, source)
            except KeyError as e:
                raise ValueError(f"{source} lacks the field {e.args[0]!r}") from None
        return cfg


# RotaryEmbedding builds cos / sin tables for every position up front: 2**22 positions (4x the
# longest context of a supported model, Qwen2.5-1M) is already gigabytes; 10**12 was an allocation error.
MAX_POSITIONS = 1 << 22
# 10**9 layers ran out of memory listing their sliding windows; the deepest released models have ~130.
# (The loader also holds num_hidden_layers to the layers the checkpoint has, before building any.)
MAX_LAYERS = 4096
_REQUIRED = object()


def _int(c: dict, key: str, source: str, default=_REQUIRED, low: int = 1, high: int | None = None) -> int:
    """c[key] as an int in [low, high]; a missing or null field takes `default` (else: lacks the field)."""
    value = c.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{source} lacks the field {key!r}")
        value = default  # checked too: head_dim's default, hidden_size // heads, may be 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
        raise ValueError(f"{source}: {key} must be {allowed}, got {value!r}")
    return value


def _float(c: dict, key: str, source: str, default: float) -> float:
    """c[key] as a finite float > 0 (rms_norm_eps, rope_theta, a RoPE scaling factor)."""
    value = c.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{source}: {key} must be a finite number > 0, got {value!r}")
    return float(value)


def _as_list(x, source: str = "config.json") -> list[int]:
    if x is None:
        return []
    values = list(x) if isinstance(x, (list, tuple)) else [x]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{source}: eos_token_id must be a token id or a list of them (integers >= 0), got {x!r}")
    return values


def _rope(c: dict, source: str, family: str = "llama") -> tuple[float, dict | None]:
    """transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(c.get(key) or {}, dict):
            raise ValueError(f"{source}: {key} must be an object such as {{\"rope_type\": \"linear\", "
                             f"\"factor\": 2.0}}, got {c[key]!r}")
    params = dict(c.get("rope_parameters") or {})
    theta = _float(params if "rope_theta" in params else c, "rope_theta", source, 10000.0)
    params.pop("rope_theta", None)
    scaling = params or dict(c.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    allowed = SUPPORTED_ROPE_TYPES + (("yarn",) if family in YARN_ARCHITECTURES else ())
    if rope_type not in allowed:
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported; "
                         f"llmopt implements {', '.join(allowed)}")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
    # the numbers RotaryEmbedding divides by: a missing one was a KeyError, a string a TypeError
    if rope_type == "freq_factors":  # one divisor per frequency, as llama.cpp's rope_freqs.weight
        factors = scaling.get("freq_factors")
        if not isinstance(factors, list) or not factors or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors):
            raise ValueError(f"{source}: freq_factors rope scaling needs 'freq_factors', a list of positive "
                             f"numbers (one per rotated pair), got {factors!r}")
        return theta, scaling
    needed = {"linear": ("factor",), "yarn": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in needed[rope_type]:
        _float(scaling, key, f"{source}: {rope_type} rope_scaling", None)
    if rope_type == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ValueError(f"{source}: llama3 rope_scaling needs low_freq_factor < high_freq_factor, got "
                         f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
    return theta, scaling


def _sliding_windows(c: dict, family: str, layers: int, source: str = "config.json") -> list[int | None]:
    window = c.get("sliding_window")
    if family == "qwen2" and not c.get("use_sliding_window", False):
        window = None
    if window is None:
        return [None] * layers
    window = _int(c, "sliding_window", source)
    types = c.get("layer_types")
    if types is None:
        first = _int(c, "max_window_layers", source, default=0, low=0) if family == "qwen2" else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise ValueError(f"{source}: layer_types must list {layers} entries (one per layer), each one of "
                         f"{', '.join(kinds)}; got {types!r}")
    return [window if t == "sliding_attention" else None for t in types]


def _deepseek(c: dict, cfg: ModelConfig, source: str) -> tuple[MLAConfig, MoEConfig]:
    """DeepSeek-V3's attention and expert shapes, as transformers' DeepseekV3Config reads them."""
    import math

    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if c.get(key, allowed) != allowed:  # what V3 (and transformers' port of it) implements
            raise ValueError(f"{source}: {key} {c[key]!r} is not supported; DeepseekV3 uses {allowed!r}")
    rope_dim = int(c["qk_rope_head_dim"])
    if rope_dim % 2:
        raise ValueError(f"{source}: qk_rope_head_dim must be even (RoPE rotates pairs), got {rope_dim}")
    scale = cfg.head_dim ** -0.5
    s = cfg.rope_scaling or {}
    if s and s.get("mscale_all_dim"):  # YaRN's attention temperature, applied to both q and k
        factor = float(s["factor"])
        m = 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    mla = MLAConfig(kv_lora_rank=int(c["kv_lora_rank"]),
                    q_lora_rank=None if c.get("q_lora_rank") is None else int(c["q_lora_rank"]),
                    qk_nope_head_dim=int(c["qk_nope_head_dim"]), qk_rope_head_dim=rope_dim,
                    v_head_dim=int(c["v_head_dim"]), rope_interleave=bool(c.get("rope_interleave", True)),
                    softmax_scale=scale)
    experts, group = int(c.get("n_routed_experts") or 0), int(c.get("n_group") or 1)
    moe = MoEConfig(n_routed_experts=experts, num_experts_per_tok=int(c.get("num_experts_per_tok") or 1),
                    moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
                    n_shared_experts=int(c.get("n_shared_experts") or 0), n_group=group,
                    topk_group=int(c.get("topk_group") or 1), norm_topk_prob=bool(c.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                    first_k_dense_replace=int(c.get("first_k_dense_replace") or 0))
    if experts and (experts % group or experts // group < 2 or moe.topk_group > group
                    or moe.num_experts_per_tok > experts // group * moe.topk_group):
        raise ValueError(f"{source}: n_routed_experts ({experts}) must split into n_group ({group}) groups "
                         f"of >= 2, topk_group ({moe.topk_group}) <= n_group, and num_experts_per_tok "
                         f"({moe.num_experts_per_tok}) <= the experts in topk_group groups")
    return mla, moe
