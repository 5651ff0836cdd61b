"""Small random DeepseekV3ForCausalLM checkpoints, written by transformers' own save_pretrained.

Shapes are DeepSeek-V3's in miniature: MLA with and without a q LoRA, YaRN RoPE with
DeepSeek's mscale (the softmax temperature) or plain RoPE, interleaved or not; grouped
top-k routing over 8 experts in 4 groups, a shared expert, a dense first layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from checkpoints import COMMON, copy_tokenizer

DEEPSEEK = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
                moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                routed_scaling_factor=2.5)

VARIANTS = {
    # DeepSeek-V3's own choices: q LoRA, YaRN with mscale = mscale_all_dim, interleaved RoPE
    "ds-yarn": dict(q_lora_rank=48, rope_interleave=True,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 64, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V2-Lite's: q without LoRA; plain RoPE, rotate-half layout; unnormalised top-k
    "ds-plain": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # mscale != mscale_all_dim: YaRN's attention factor scales cos and sin too
    "ds-mscale": dict(q_lora_rank=24, rope_interleave=True,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                       "original_max_position_embeddings": 32, "mscale": 0.707,
                                       "mscale_all_dim": 1.0}),
}


def write_deepseek(name: str, folder: Path) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**DEEPSEEK, **VARIANTS[name]})
    torch.manual_seed(sum(map(ord, name)))
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # a trained router's bias is not zero: give the correction a part to play
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return folder
