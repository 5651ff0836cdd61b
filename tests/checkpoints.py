"""Small random-weight Hugging Face checkpoints of each supported architecture, for parity tests.

Written with transformers' own `save_pretrained`, so they are exactly what a user's
folder would hold; the bundled tokenizer is copied in so `LLM(model=folder)` works.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from llmopt import model_path

VOCAB = 4096  # the bundled tokenizer's vocabulary

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.1, bos_token_id=1, eos_token_id=0, pad_token_id=2)

CHECKPOINTS = {
    # Llama 3 style: GQA, llama3 RoPE scaling, untied head, biases on attention and MLP
    "llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32},
                             attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    # Llama 2 style with linear RoPE scaling and tied embeddings, MQA (one KV head)
    "llama-tied": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                  "factor": 2.0},
                                 num_key_value_heads=1, tie_word_embeddings=True)),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 1000000.0})),
    # Mistral: a sliding window short enough that 64 generated tokens cross it
    "mistral": ("mistral", dict(sliding_window=24, head_dim=16, tie_word_embeddings=False)),
}


def write_checkpoint(name: str, folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = CHECKPOINTS[name]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return folder


def copy_tokenizer(folder: Path) -> None:
    src = model_path("tiny")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy(src / f, folder / f)


def hf_model(folder):
    """transformers' own model of a checkpoint folder, in float32, for the reference logits."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def assert_flat_logits_match(ours, ref, lengths: list[int], atol: float = 1e-4):
    """Random sequences of `lengths`, each run alone by transformers, all flattened into one
    varlen batch by llmopt (no KV cache): every position's logits must agree within `atol`.
    Returns (sequences, transformers' logits) for further checks."""
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.model.forward import run_model
    from llmopt.worker.kv_cache import NoKVCache

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]
    expected = [ref(input_ids=s[None]).logits[0] for s in seqs]
    flat = ours.compute_logits(run_model(ours, NoKVCache(), torch.cat(seqs), AttentionMetadata.uncached(lengths)))
    for n, got, want in zip(lengths, flat.split(lengths), expected):
        err = (got - want).abs().max().item()
        assert err <= atol, f"sequence of {n} tokens: logits differ by {err:.2e} (allowed {atol:.0e})"
    return seqs, expected
