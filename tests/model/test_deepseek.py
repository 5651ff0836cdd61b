"""DeepSeek-V3 (MLA + mixture of experts) equals transformers' DeepseekV3ForCausalLM.

Random small checkpoints of each variant (tests/deepseek_checkpoints.py): logits within 1e-4
in float32, through the naive path and through the paged engine's pool, and greedy
generation token-identical to `transformers.generate`.
"""

import pytest
import torch

from checkpoints import assert_flat_logits_match, hf_model
from deepseek_checkpoints import VARIANTS, write_deepseek
from llmopt import LLM, SamplingParams
from llmopt.model.config import ModelConfig
from llmopt.model.loader import load_model

NAMES = list(VARIANTS)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = write_deepseek(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.parametrize("name", NAMES)
@torch.inference_mode()
def test_logits_match_transformers(name, deepseek_dir):
    folder = deepseek_dir(name)
    # 90 > original_max_position_embeddings: YaRN's interpolated band is used
    assert_flat_logits_match(load_model(folder), hf_model(folder), [5, 17, 90])


def test_config_reads_deepseek_fields(deepseek_dir):
    cfg = ModelConfig.from_pretrained(deepseek_dir("ds-yarn"))
    assert cfg.mla.kv_lora_rank == 32 and cfg.mla.q_lora_rank == 48 and cfg.head_dim == 32
    assert cfg.moe.n_routed_experts == 8 and cfg.moe.first_k_dense_replace == 1
    # YaRN's mscale(4, 1)^2 multiplies the softmax scale, as transformers' yarn_apply_mscale does
    assert cfg.mla.softmax_scale == pytest.approx(32 ** -0.5 * (0.1 * torch.tensor(4.0).log().item() + 1) ** 2)


def test_bad_deepseek_configs_are_named():
    base = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2,
            "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}
    ModelConfig.from_hf(base)
    with pytest.raises(ValueError, match="scoring_func"):
        ModelConfig.from_hf({**base, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 3})
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        ModelConfig.from_hf({**base, "qk_rope_head_dim": 3})


@pytest.mark.parametrize("name", ["ds-yarn"])  # (the other variants: logits above)
def test_greedy_generation_matches_transformers(name, deepseek_dir, one_thread):
    folder = deepseek_dir(name)
    llm = LLM(model=str(folder), num_kv_blocks=64, block_size=8)
    ref = hf_model(folder)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (3, 11, 29)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            want = ref.generate(input_ids=torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                eos_token_id=None, pad_token_id=2)[0, len(p):].tolist()
            assert o.outputs[0].token_ids == want
