"""A Llama-family decoder (Llama 2/3, Qwen2, Mistral) in one readable file.

    tokens -> embed -> N x [RMSNorm -> attention (RoPE, GQA) -> + residual
                            RMSNorm -> SwiGLU MLP           -> + residual] -> RMSNorm -> lm_head

The forward works on a flat batch: `input_ids` is 1-D over all new tokens of all sequences
in the step, and the step's metadata (which tokens belong to which sequence, their positions,
where their keys go; llmopt.layers.attention) is passed down to every layer. q/k/v are one fused matmul, and gate/up another (as vLLM does): fewer,
larger matmuls are faster on every device; the loader splices the checkpoint's
separate q_proj/k_proj/v_proj and gate_proj/up_proj into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.layers.attention import AttentionMetadata, attention
from llmopt.layers.norm import RMSNorm
from llmopt.layers.rotary import RotaryEmbedding
from llmopt.model.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = cfg.sliding_windows[layer_idx] if cfg.sliding_windows else None
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, meta: AttentionMetadata, x, rotary: RotaryEmbedding, kv_cache):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(meta.positions, q, k)
        out = attention(q, k, v, meta, kv_cache, self.layer_idx, self.scale, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, meta, x, rotary, kv_cache):
        x = x + self.self_attn(meta, self.input_layernorm(x), rotary, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """embed -> N decoder layers -> norm, with the RoPE table the layers share (CausalLM.forward
    runs them).

    The layer class is what makes the architecture: Llama's (above) here, DeepSeek's (MLA
    attention, MoE MLP) in deepseek.py; `rotary_dim` is the width RoPE turns (the whole head
    here, only the decoupled RoPE part of MLA's key there)."""

    def __init__(self, cfg: ModelConfig, layer_cls=LlamaDecoderLayer, rotary_dim: int | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(rotary_dim or cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_scaling)


class CausalLM(nn.Module):
    """A decoder stack and the lm_head that scores its last hidden states over the vocabulary."""

    def __init__(self, cfg: ModelConfig, model: DecoderStack):
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # one matrix reads tokens in and scores them out
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for a flat batch of new tokens laid out by `meta`."""
        stack = self.model
        stack.rotary_emb.new_step()
        x = stack.embed_tokens(input_ids)
        for layer in stack.layers:
            x = layer(meta, x, stack.rotary_emb, kv_cache)
        return stack.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderStack(cfg))

    # Checkpoint name -> (our fused parameter, which shard of it).
    stacked_params = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def quantizable_linears(self) -> dict[str, list[str]]:
        """The decoder's linear layers (the ones quantization replaces; the embedding and
        lm_head stay dense, as AutoGPTQ, AutoAWQ and vLLM keep them), each with the
        checkpoint module names it is stored under."""
        out = {}
        for name, _ in self.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                parts = [name[:-len(leaf)] + part for fused, part, _ in self.stacked_params if fused == leaf]
                out[name] = parts or [name]
        return out

    def shard_rows(self, fused: str, shard: int) -> tuple[int, int]:
        """Row range of a checkpoint shard inside our fused weight."""
        c = self.config
        if fused == "qkv_proj":
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        i = c.intermediate_size
        return [(0, i), (i, 2 * i)][shard]
