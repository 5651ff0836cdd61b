"""An EAGLE-style draft head: one decoder layer that extrapolates the target's features.

A small draft *model* must rediscover from tokens alone what the target already knows.
EAGLE (Li et al., 2024) drafts one level up: the target's last hidden state ("feature")
at position p-1 already encodes what comes next, so a single decoder layer that sees
that feature plus the embedding of the token actually chosen at p can predict the
target's feature at p, and the target's own lm_head turns it into a next-token guess:

    x_p      = fc([embed(token_p) ; feature_{p-1}])          2*hidden -> hidden
    f'_p     = norm(decoder_layer(x_p))                      attends over the head's own KV
    logits   = target.lm_head(f'_p)                          guess for token_{p+1}

Drafting k tokens feeds each guess back with the head's own predicted feature. Only the
first position of a proposal sees a true target feature; verified positions are fed
again with the true features in the next proposal, as EAGLE does.

The features are the target's final hidden states after its last norm (what the engine's
forward returns), so the head's output lives in the space the lm_head reads. The head
shares the target's embedding and lm_head and has its own one-layer paged KV cache.
Checkpoint names follow the EAGLE release layout: `fc.*`, `layers.0.*`, plus `norm.weight`.

A head may also ship `draft_vocab.json`, the target token ids it drafts from (EAGLE-3's
reduced draft vocabulary): on a large vocabulary the lm_head is most of a draft step's
cost, and the few thousand tokens a model actually writes carry nearly all of its choices.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmopt.layers.norm import RMSNorm
from llmopt.layers.rotary import RotaryEmbedding
from llmopt.model.config import ModelConfig
from llmopt.model.llama import LlamaDecoderLayer, LlamaForCausalLM

ARCHITECTURE = "EagleLlamaForCausalLM"


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, 0)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_scaling)
        self.draft_vocab: torch.Tensor | None = None  # token ids it drafts from (None: all)

    def forward(self, token_embeds: torch.Tensor, prev_features: torch.Tensor,
                meta, kv_cache) -> torch.Tensor:
        """Predicted target features [n, hidden] for a flat batch of n positions laid out by `meta`."""
        x = self.fc(torch.cat([token_embeds, prev_features], dim=-1))
        x = self.layers[0](meta, x, self.rotary_emb, kv_cache)
        return self.norm(x)

    # the loader's names for fused q/k/v and gate/up are the decoder's
    stacked_params = LlamaForCausalLM.stacked_params
    shard_rows = LlamaForCausalLM.shard_rows


def head_config(target: ModelConfig) -> dict:
    """config.json of a head for `target`: the target's shapes, one layer."""
    return {"architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
            "num_attention_heads": target.num_attention_heads,
            "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
            "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps,
            "max_position_embeddings": target.max_position_embeddings,
            "rope_theta": target.rope_theta, "vocab_size": target.vocab_size,
            "tie_word_embeddings": False}


def load_eagle_head(folder: str | Path, target: ModelConfig, dtype=torch.float32,
                    device="cpu") -> EagleHead:
    """Load a head saved by scripts/train_eagle_head.py, checking it fits `target`."""
    from llmopt.model.loader import iter_checkpoint, load_weights, safetensors_files

    folder = Path(folder)
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"EAGLE head {folder}: config.json is missing or invalid ({e})") from None
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(f"{path}: architectures must include {ARCHITECTURE!r} for an EAGLE head, "
                         f"got {raw.get('architectures')}")
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        if raw.get(key) != getattr(target, key):
            raise ValueError(f"EAGLE head {folder} was trained for a target with {key}="
                             f"{raw.get(key)}, but the target has {getattr(target, key)}")
    cfg = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"]}, str(path))
    with torch.device("meta"):
        head = EagleHead(cfg)
    head = head.to_empty(device=device).to(dtype)
    head.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling).to(device)
    load_weights(head, iter_checkpoint(safetensors_files(folder)), source=str(folder))
    vocab = folder / "draft_vocab.json"
    if vocab.is_file():
        ids = json.loads(vocab.read_text())
        if not ids or not all(isinstance(t, int) and 0 <= t < target.vocab_size for t in ids):
            raise ValueError(f"{vocab}: must list token ids in 0..{target.vocab_size - 1}")
        head.draft_vocab = torch.tensor(sorted(set(ids)), device=device)
    return head.eval()
