"""Building a decoder from its config: which class, the parts no checkpoint stores (a tied head,
the RoPE table), and giving the memory a build frees back to the operating system. Every way
of making a model (a checkpoint, a GGUF file's blocks, random weights) goes through these."""

from __future__ import annotations

import ctypes

import torch

from llmopt.layers.rotary import RotaryEmbedding
from llmopt.model.config import ModelConfig
from llmopt.model.llama import LlamaForCausalLM


def model_class(cfg: ModelConfig):
    """The decoder class for a config: DeepSeek-V3's (MLA + MoE), else the Llama family's."""
    if cfg.mla is not None:
        from llmopt.model.deepseek import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM
    return LlamaForCausalLM


def meta_model(cfg: ModelConfig, dtype: torch.dtype | None = None):
    """The decoder on the meta device (shapes only: no memory, no random init), cast to `dtype`
    there so that allocating it later allocates once, in that dtype."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return model if dtype is None else model.to(dtype)


def tie_and_rotate(model, cfg: ModelConfig, device) -> None:
    """What no checkpoint stores: the tied head (the embedding itself, where both are dense) and
    the RoPE table."""
    if cfg.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear) and \
            isinstance(model.model.embed_tokens, torch.nn.Embedding):
        model.lm_head.weight = model.model.embed_tokens.weight
    rope_dim = cfg.mla.qk_rope_head_dim if cfg.mla is not None else cfg.head_dim
    model.model.rotary_emb = RotaryEmbedding(rope_dim, cfg.max_position_embeddings,
                                             cfg.rope_theta, cfg.rope_scaling).to(device)


def trim_heap() -> None:
    """Give the memory freed so far (dequantized temporaries, the header's objects, replaced
    weights) back to the OS with glibc's malloc_trim (a few ms): glibc keeps freed blocks below
    32 MB in its heap, where they still count against a container's limit (Binder's 2 GB).
    Elsewhere (macOS, musl) this does nothing. No gc.collect() here: what loading frees goes by
    reference counts, and a full collection in a notebook holding millions of objects took 0.3-0.7 s,
    paid at every engine made (lesson 05 makes about forty)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
