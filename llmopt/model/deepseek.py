"""DeepSeek-V3 (`DeepseekV3ForCausalLM` checkpoints in Hugging Face format) in one file.

    tokens -> embed -> N x [RMSNorm -> MLA (latent KV, decoupled RoPE key) -> + residual
                            RMSNorm -> MLP (first_k_dense_replace layers) or MoE -> + residual]
           -> RMSNorm -> lm_head

The two ideas live in llmopt/layers: multi-head latent attention (mla.py: the cache holds
one latent + RoPE key per token, the up-projections are absorbed into query and output)
and the mixture of experts (moe.py: sigmoid router with bias-corrected, grouped top-k;
shared experts; tokens grouped by expert). The decoder layer's signature is the Llama
one's, so the engine, the proposers and the layer-skip draft drive both alike.

Checkpoint names follow transformers: `mlp.experts.{e}.gate_proj.weight` etc. are spliced
into the stacked `w13` / `w2`, `gate_proj` + `up_proj` into one `gate_up_proj`; the
multi-token-prediction layer some checkpoints append (model.layers.{N}) is not run.
"""

from __future__ import annotations

import re

from torch import nn

from llmopt.layers.mla import MLAttention
from llmopt.layers.moe import MoE, SwiGLU
from llmopt.layers.norm import RMSNorm
from llmopt.model.config import ModelConfig
from llmopt.model.llama import CausalLM, DecoderStack

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx, cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        if moe.n_routed_experts and layer_idx >= moe.first_k_dense_replace:
            self.mlp = MoE(cfg.hidden_size, moe)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, meta, x, rotary, kv_cache):
        x = x + self.self_attn(meta, self.input_layernorm(x), rotary, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3ForCausalLM(CausalLM):
    """Llama's stack and head around DeepSeek's layer; RoPE turns only MLA's decoupled key part."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderStack(cfg, DeepseekV3DecoderLayer, cfg.mla.qk_rope_head_dim))

    def moe_layers(self) -> dict[int, MoE]:
        """Layer index -> its MoE block (the dense first layers have none)."""
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, MoE)}

    # -- checkpoint layout ----------------------------------------------------------------------
    def checkpoint_target(self, name: str):
        """Checkpoint tensor name -> (our parameter name, the index of its part, or None)."""
        m = _EXPERT.match(name)
        inter = self.config.moe.moe_intermediate_size
        if m:
            prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
            if part == "down_proj":
                return f"{prefix}.w2", e
            return f"{prefix}.w13", (e, slice(0, inter) if part == "gate_proj" else slice(inter, 2 * inter))
        for part, half in (("gate_proj", 0), ("up_proj", 1)):
            if f".{part}." in name:
                size = (self.config.moe.moe_intermediate_size * self.config.moe.n_shared_experts
                        if ".shared_experts." in name else self.config.intermediate_size)
                return name.replace(part, "gate_up_proj"), slice(half * size, (half + 1) * size)
        return name, None

    def checkpoint_names(self, param: str) -> list[str]:
        """Our parameter name -> the checkpoint tensors that fill it."""
        prefix, _, leaf = param.rpartition(".")
        experts = range(self.config.moe.n_routed_experts)
        if leaf == "w13":
            return [f"{prefix}.experts.{e}.{p}.weight" for e in experts for p in ("gate_proj", "up_proj")]
        if leaf == "w2":
            return [f"{prefix}.experts.{e}.down_proj.weight" for e in experts]
        if ".gate_up_proj." in param:
            return [param.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
        return [param]

    stacked_params: list = []  # (the loader asks checkpoint_target instead)

    def quantizable_linears(self) -> dict[str, list[str]]:
        raise ValueError("quantization is not implemented for DeepseekV3ForCausalLM in llmopt; "
                         "load it with quantization=None")
