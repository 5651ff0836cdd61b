"""Rotations before quantizing (QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et al. 2024), weight-only.

A linear layer's rounding error is worst where a few input channels or weights are far larger
than the rest. Multiplying the residual stream by an orthogonal matrix Q spreads every such
outlier over all channels, and the model computes exactly the same function if each weight
that reads the stream becomes W Q and each weight that writes it Q^T W. Quantizing the rotated
weights then loses less: their groups hold no lone giants.

Two things must happen first. RMSNorm divides by the root mean square, which a rotation does
not change, but then multiplies by a per-channel weight g, which does not commute with Q: so g
is fused into the linears the norm feeds (W diag(g)) and the norm keeps weight 1. And a tied
embedding cannot stay tied: the embedding becomes E Q, the head E diag(g_final) Q, so the
head is untied and stored (SmolLM2: 28M more full-precision numbers in the checkpoint).

Rotations here (all folded into the weights; none runs at inference):
- R1, the residual stream: a randomized Hadamard matrix H diag(+-1) / sqrt(d), as QuaRot;
- R2, each attention head's values: v_proj's output rows and o_proj's input columns of every
  head turned by one head_dim Hadamard (with grouped-query attention every query head reads its
  KV head's values, so one matrix serves all).
QuaRot's online rotation before down_proj needs a Hadamard transform at run time and is not done;
the one of queries, keys and values for an FP8 KV cache is `PagedKVCache.rotate` (llmopt.worker.kv_cache).
"""

from __future__ import annotations

import torch

from llmopt.layers.hadamard import random_hadamard

ROTATIONS = ("hadamard",)


def _set(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.to(param.dtype).contiguous()


@torch.no_grad()
def fuse_norms(model) -> None:
    """Fold every RMSNorm's weight into the linears it feeds; the norms keep weight 1.
    Unties a tied head first (the head takes the final norm's weight, the embedding does not)."""
    if model.config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.data.clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    pairs = [(layer.input_layernorm, [layer.self_attn.qkv_proj]) for layer in model.model.layers]
    pairs += [(layer.post_attention_layernorm, [layer.mlp.gate_up_proj]) for layer in model.model.layers]
    pairs.append((model.model.norm, [model.lm_head]))
    for norm, linears in pairs:
        g = norm.weight.data.double()
        for lin in linears:
            _set(lin.weight, lin.weight.data.double() * g[None, :])
        norm.weight.data.fill_(1.0)


@torch.no_grad()
def rotate_model(model, seed: int = 0) -> dict:
    """Fuse the norms, then apply R1 and R2 in place; the model computes the same logits (up to
    float rounding). Returns what was done, for the checkpoint's quantization_config."""
    cfg = model.config
    if getattr(cfg, "mla", None) is not None or getattr(cfg, "moe", None) is not None:
        raise ValueError("rotation='hadamard' supports the Llama family (dense MLP, per-head K/V), not MLA or MoE")
    tied = cfg.tie_word_embeddings
    fuse_norms(model)
    q1 = random_hadamard(cfg.hidden_size, seed)
    emb = model.model.embed_tokens.weight
    _set(emb, emb.data.double() @ q1)
    readers = [model.lm_head] + [m for layer in model.model.layers
                                 for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]
    for lin in readers:                                   # y = W x  ->  (W Q)(Q^T x)
        _set(lin.weight, lin.weight.data.double() @ q1)
    for layer in model.model.layers:                      # h += W z  ->  Q^T h += (Q^T W) z
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            _set(lin.weight, q1.t() @ lin.weight.data.double())
            if lin.bias is not None:
                _set(lin.bias, lin.bias.data.double() @ q1)
    q2 = random_hadamard(cfg.head_dim, seed + 1)
    q_size, kv_size, d = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim
    for layer in model.model.layers:
        qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
        w = qkv.weight.data.double()
        v = w[q_size + kv_size:].reshape(cfg.num_key_value_heads, d, -1)
        w[q_size + kv_size:] = torch.einsum("ji,hjk->hik", q2, v).reshape(kv_size, -1)   # rows: Q2^T v
        _set(qkv.weight, w)
        if qkv.bias is not None:
            b = qkv.bias.data.double()
            b[q_size + kv_size:] = (b[q_size + kv_size:].reshape(-1, d) @ q2).reshape(-1)
            _set(qkv.bias, b)
        wo = o.weight.data.double().reshape(-1, cfg.num_attention_heads, d)
        _set(o.weight, (wo @ q2).reshape(-1, q_size))                                      # columns: W_o Q2
    return {"rotation": "hadamard", "seed": seed, "untied_lm_head": tied}
