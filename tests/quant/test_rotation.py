"""Hadamard rotations before quantizing: the matrices are orthogonal Hadamards, the rotated
model computes the same logits before quantization (tied and untied heads, GQA, biases), and
`quantize(..., rotation="hadamard")` writes checkpoints the engine loads."""

import json

import pytest
import torch

from llmopt.layers.hadamard import hadamard_matrix, random_hadamard
from llmopt.quant.rotation import rotate_model


@pytest.mark.parametrize("n", [1, 2, 12, 16, 20, 48, 64, 384, 576])
def test_hadamard_matrices(n):
    h = hadamard_matrix(n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))
    q = random_hadamard(n, seed=3)
    assert torch.allclose(q @ q.t(), torch.eye(n, dtype=torch.float64), atol=1e-12)


def test_orders_without_a_construction_are_refused():
    with pytest.raises(ValueError, match="2\\^a \\* 12\\^b \\* 20\\^c"):
        hadamard_matrix(36)


def logits(model, ids):
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.model.forward import run_model
    from llmopt.worker.kv_cache import NoKVCache

    with torch.no_grad():
        hidden = run_model(model, NoKVCache(), torch.tensor(ids), AttentionMetadata.uncached([len(ids)]))
        return model.compute_logits(hidden).double()


@pytest.mark.parametrize("name", ["llama3", "qwen2", "llama-tied"])
def test_rotated_model_computes_the_same_logits(checkpoint_dir, name):
    from llmopt.model.loader import load_model

    folder = checkpoint_dir(name)
    model = load_model(folder)
    ids = list(range(3, 200, 7))
    want = logits(model, ids)
    tied = model.config.tie_word_embeddings
    before = model.model.layers[0].self_attn.qkv_proj.weight.clone()
    info = rotate_model(model, seed=0)
    assert info["untied_lm_head"] == tied and not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
               for layer in model.model.layers)
    assert not torch.allclose(before, model.model.layers[0].self_attn.qkv_proj.weight)
    got = logits(model, ids)
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * want.abs().max())


def test_rotation_spreads_outliers():
    from llmopt import model_path
    from llmopt.model.loader import load_model

    model = load_model(model_path("tiny"))
    w = model.model.layers[0].mlp.gate_up_proj.weight
    kurt = lambda t: float(((t - t.mean()) ** 4).mean() / t.var() ** 2)  # noqa: E731  (t detached)
    before = kurt((w * model.model.layers[0].post_attention_layernorm.weight).detach())
    rotate_model(model)
    assert kurt(model.model.layers[0].mlp.gate_up_proj.weight.detach()) < before


def test_quantize_with_rotation_loads_and_keeps_the_function(tmp_path):
    from llmopt import LLM, SamplingParams, model_path
    from llmopt.eval import perplexity
    from llmopt.quant import quantize

    r = quantize("tiny", method="rtn", bits=8, group_size=64, rotation="hadamard", out=tmp_path / "r8",
                 progress=False)
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["meta"]["rotation"] == "hadamard"
    rotated, dense = LLM(str(r.path)), LLM(str(model_path("tiny")))
    p_rot, p_dense = perplexity(rotated, max_tokens=1024), perplexity(dense, max_tokens=1024)
    assert abs(p_rot / p_dense - 1) < 0.01          # int8 of a rotated model: the same model, nearly
    out = rotated.generate(["def f(x):"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="rotation"):
        quantize("tiny", method="rtn", rotation="spin", out=tmp_path / "x")
