"""The GPU's decode step with its elementwise work fused: what a CUDA graph records.

The same decoder layers as the model's forward (llmopt/model/llama.py), the same linears and the
same attention over the pool, with each layer's elementwise pieces in one Triton kernel each
(llmopt/kernels/fused_step.py): the residual add and the next RMSNorm together, RoPE for q and k,
silu(gate) * up. The residual stream is carried beside the normed activations, as vLLM's layers
carry it, so each add rides in the norm after it:

    x, s = norm(h)                     s: the residual stream
    h = o_proj(attention(rope(qkv(x))))
    x, s = add_norm(h, s)              s = h + s, x = norm(s)
    h = down(silu_mul(gate_up(x)))
    ... next layer: x, s = add_norm(h, s); after the last: the final norm the same way

A layer is about ten kernels instead of about forty: at batch 1 on a GPU the step's time is
mostly these kernels' fixed cost, so the count is the speed (benchmarks/gpu_speed.py measures it).
"""

from __future__ import annotations

import torch

from llmopt.kernels import triton_usable
from llmopt.layers.attention import AttentionMetadata, attention


def why_not_fused(model, device) -> str | None:
    """Why this model's decode step cannot run through the fused kernels (None when it can)."""
    from llmopt.layers.norm import RMSNorm
    from llmopt.model.llama import LlamaDecoderLayer

    if not triton_usable(device):
        return "the fused kernels are Triton's (a CUDA device, or TRITON_INTERPRET=1)"
    stack = model.model
    if not all(type(layer) is LlamaDecoderLayer for layer in stack.layers):
        return "it fuses Llama-family decoder layers"
    if type(stack.norm) is not RMSNorm or stack.rotary_emb.cos.shape[-1] != stack.layers[0].self_attn.head_dim:
        return "it fuses RMSNorm and RoPE over the whole head"
    head_dim = stack.layers[0].self_attn.head_dim
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two (the RoPE kernel's halves are blocks)"
    return None


def fused_forward(model, kv_cache, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """`run_model`'s hidden states [num_tokens, hidden], the elementwise work through the kernels."""
    from llmopt.kernels.fused_step import add_rms_norm, rotary, silu_mul

    stack = model.model
    rope = stack.rotary_emb
    kv_cache.begin_step(meta)
    h, s = stack.embed_tokens(input_ids), None
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        x, s = add_rms_norm(h.contiguous(), norm.weight, norm.eps, s)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = rotary(meta.positions, q.view(-1, attn.num_heads, attn.head_dim),
                      k.view(-1, attn.num_kv_heads, attn.head_dim), rope.cos, rope.signed_sin)
        out = attention(q, k, v.view(-1, attn.num_kv_heads, attn.head_dim), meta, kv_cache, attn.layer_idx,
                        attn.scale, attn.window)
        h = attn.o_proj(out.reshape(-1, attn.q_size))
        norm = layer.post_attention_layernorm
        x, s = add_rms_norm(h.contiguous(), norm.weight, norm.eps, s)
        h = mlp.down_proj(silu_mul(mlp.gate_up_proj(x).contiguous()))
    return add_rms_norm(h.contiguous(), stack.norm.weight, stack.norm.eps, s)[0]
