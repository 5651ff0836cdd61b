"""Real shapes without weights: `LLM(model=<shape>, load_format="dummy")` (llmopt.model.dummy).

The shipped configs must be the real models' (their parameter counts are the published
ones, counted on the meta device: nothing allocated); each builds and runs at a small size
with the same structure (heads, KV groups, biases, tied head, RoPE scaling); and whatever
would read meaning into random weights is refused before any work."""

from __future__ import annotations

import json

import numpy as np

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.model import dummy
from llmopt.model.config import ModelConfig
from llmopt.model.build import meta_model
from llmopt.model.loader import load_model
from llmopt.model.registry import SHAPES, list_models, model_path

# the counts the models' cards publish (1.24B, 0.49B, 1.54B, 8.03B), to the parameter
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768,
             "qwen2.5-1.5b": 1_543_714_304, "llama-3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shipped_configs_are_the_real_models(name):
    assert set(PUBLISHED) == set(SHAPES)
    cfg = ModelConfig.from_pretrained(model_path(name))
    assert sum(p.numel() for p in meta_model(cfg).parameters()) == PUBLISHED[name]   # tied: counted once
    assert "load_format='dummy'" in list_models()[name]


def small_shape(name, tmp_path):
    """The shipped config at a test's size: 2 layers, head_dim 16, the same heads and structure."""
    c = json.loads((model_path(name) / "config.json").read_text())
    c.update(num_hidden_layers=2, head_dim=16, hidden_size=16 * c["num_attention_heads"],
             intermediate_size=32 * c["num_attention_heads"], vocab_size=4096, max_position_embeddings=512)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(c))
    return folder


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_small_shapes_build_and_run(name, tmp_path):
    folder = small_shape(name, tmp_path)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(100, 130))}]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(folder), tokenizer=name, load_format="dummy", enforce_eager=eager, num_kv_blocks=32)
        outs[eager] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert all(o.text == "" and len(o.token_ids) == 6 for o in outs[eager])   # ids only, no text
        model = llm.model
        assert model.model.norm.weight.eq(1).all()
        w = model.model.layers[0].mlp.down_proj.weight.float()
        assert abs(w.std().item() - dummy.DEFAULT_STD) < 2e-3 and w.mean().abs() < 2e-3
        assert torch.unique(w, dim=0).shape[0] == w.shape[0]           # no row repeats another
        if ModelConfig.from_pretrained(folder).qkv_bias:                 # Qwen2: q/k/v biases, zero
            assert model.model.layers[0].self_attn.qkv_proj.bias.eq(0).all()
        del llm
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]


def test_same_seed_same_weights_and_dtype_as_asked(tmp_path):
    folder = small_shape("llama-3.2-1b", tmp_path)
    a = load_model(folder, torch.bfloat16, load_format="dummy", seed=3)
    b = load_model(folder, torch.bfloat16, load_format="dummy", seed=3)
    c = load_model(folder, torch.bfloat16, load_format="dummy", seed=4)
    wa, wb, wc = (m.model.layers[1].self_attn.o_proj.weight for m in (a, b, c))
    assert wa.dtype == torch.bfloat16 and torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.lm_head.weight is a.model.embed_tokens.weight                  # tied, as the config says


def test_tile_over_lays_the_pool_end_to_end():
    flat, pool = torch.empty(23), torch.arange(5.0)
    dummy.tile_over(flat, pool)
    assert flat.tolist() == [float(i % 5) for i in range(23)]


def test_int8_on_load_runs_on_random_weights(tmp_path):
    folder = small_shape("qwen2.5-0.5b", tmp_path)
    llm = LLM(str(folder), tokenizer="qwen2.5-0.5b", load_format="dummy", quantization="int8", num_kv_blocks=16)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


# -- what is refused, and why -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def dummy_llm(tmp_path_factory):
    return LLM(str(small_shape("llama-3.2-1b", tmp_path_factory.mktemp("shape"))), tokenizer="llama-3.2-1b",
               load_format="dummy", num_kv_blocks=16, enforce_eager=True)


@pytest.mark.parametrize("what", ["text prompt", "prompt dict of text", "chat", "perplexity", "stop strings"])
def test_meaning_from_random_weights_is_refused(dummy_llm, what):
    from llmopt.eval import perplexity

    calls = {"text prompt": lambda: dummy_llm.generate("def f(x):"),
             "prompt dict of text": lambda: dummy_llm.generate({"prompt": "def f(x):"}),
             "chat": lambda: dummy_llm.chat([{"role": "user", "content": "hi"}]),
             "perplexity": lambda: perplexity(dummy_llm, "some text to score, long enough"),
             "stop strings": lambda: dummy_llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["\n"]))}
    with pytest.raises(ValueError, match="load_format='dummy'.*random weights.*prompt_token_ids"):
        calls[what]()
    # the engine holds nothing of the refused call and serves the next one
    out = dummy_llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, ignore_eos=True),
                             use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_shape_without_dummy_says_how_to_load_it():
    with pytest.raises(ValueError, match="no model.safetensors.*load_format='dummy'"):
        LLM("llama-3.2-1b")


@pytest.mark.parametrize("kwargs, match", [
    ({"load_format": "safetensors"}, "load_format must be 'auto'.*or 'dummy'"),
    ({"load_format": "dummy", "quantization": "gguf"}, "quantize --method gguf --load-format dummy"),
    ({"load_format": "dummy", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative_config"),
])
def test_bad_load_format_arguments_fail_before_loading(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("llama-3.2-1b", **kwargs)


def test_a_shape_too_big_for_memory_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(dummy, "available_bytes", lambda device: 2 * 2**30)   # a 2 GiB machine
    with pytest.raises(ValueError, match=r"llama-3.2-1b .* float32 needs 4\.6 GiB.*2\.0 GiB.*bfloat16"):
        LLM("llama-3.2-1b", load_format="dummy", dtype="float32")


# -- random weights written as GGUF files (llmopt.quant.gguf_write.DummyBlocks) ----------------------
def gguf_shape(tmp_path):
    """Llama 3.2 1B's structure (tied head, Llama 3 RoPE) at rows of 256, so every type is its own;
    tiny's tokenizer (4,096 tokens: a GGUF header of SmolLM2's 49,152 takes seconds to parse)."""
    import shutil

    folder = small_shape("llama-3.2-1b", tmp_path)
    c = json.loads((folder / "config.json").read_text())
    c.update(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    (folder / "config.json").write_text(json.dumps(c))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path("tiny") / f, folder)
    return folder


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_K_M"])
def test_dummy_gguf_files_hold_random_weights_llmopt_reads(qtype, tmp_path):
    from gguf.quants import dequantize

    from llmopt.model.gguf import gguf_hf_config, gguf_tensors
    from llmopt.quant.gguf_write import write_gguf

    folder = gguf_shape(tmp_path)
    r = write_gguf(folder, qtype, tmp_path / f"{qtype}.gguf", load_format="dummy", seed=1)
    tensors = {t.name: t for t in gguf_tensors(r.path)}
    if qtype == "Q4_K_M":
        assert r.tensor_types == {"F32": 5, "Q4_K": 12, "Q6_K": 3}   # Q6_K: the head, layer 1's attn_v, ffn_down
    for name in ("blk.0.ffn_down.weight", "token_embd.weight", "blk.1.attn_q.weight"):
        w = dequantize(tensors[name].data, tensors[name].tensor_type)
        assert abs(w.std() - 0.02) < 2e-3 and abs(w.mean()) < 2e-3, name   # the dummy model's scale
        assert len(np.unique(w, axis=0)) == w.shape[0]                      # no row repeats another
    norm = tensors["blk.0.attn_norm.weight"]
    assert np.all(dequantize(norm.data, norm.tensor_type) == 1)
    # Llama 3's RoPE travels as llama.cpp's per-frequency factors, and comes back as the same table
    assert gguf_hf_config(r.path)["rope_scaling"]["rope_type"] == "freq_factors"
    from_gguf = load_model(r.path)
    from_config = load_model(folder, load_format="dummy")
    assert torch.allclose(from_gguf.model.rotary_emb.cos, from_config.model.rotary_emb.cos, atol=1e-6)
    for quantization in (None, "gguf"):
        llm = LLM(str(r.path), tokenizer=str(folder), quantization=quantization, num_kv_blocks=16)
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    # kept as blocks, the model holds no float copy of a quantized tensor: the embedding is looked
    # up in the head's own blocks, and the parameters left are the norms'
    from llmopt.layers.quant.gguf_embedding import GGUFEmbedding

    embed, head = llm.model.model.embed_tokens, llm.model.lm_head
    if qtype != "F16":
        assert isinstance(embed, GGUFEmbedding) and embed.weight_blocks is head.weight_blocks
        ids = torch.tensor([[5, 4095, 5]])
        assert torch.equal(embed(ids)[0], head.weight_blocks.dequantize()[ids[0]])
        assert sum(p.numel() * p.element_size() for p in llm.model.parameters()) < 0.01 * r.file_bytes


def test_writing_a_shape_needs_dummy_and_a_llama(tmp_path):
    from llmopt.quant.gguf_write import write_gguf

    with pytest.raises(ValueError, match="no weights.*load_format='dummy'"):
        write_gguf("llama-3.2-1b", "Q4_0", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="plain llama architecture"):
        write_gguf("qwen2.5-0.5b", "Q4_0", tmp_path / "x.gguf", load_format="dummy")
    with pytest.raises(ValueError, match="load_format must be"):
        write_gguf("llama-3.2-1b", "Q4_0", tmp_path / "x.gguf", load_format="random")


def test_cli_writes_a_shape_with_load_format_dummy(tmp_path):
    import subprocess
    import sys

    folder, out = gguf_shape(tmp_path), tmp_path / "s.gguf"
    run = [sys.executable, "-m", "llmopt", "quantize", "--method", "gguf", "--model", str(folder), "--no-progress"]
    ok = subprocess.run(run + ["--qtype", "Q8_0", "--load-format", "dummy", "--out", str(out)],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "GGUF Q8_0" in ok.stdout and out.stat().st_size > 0, ok.stderr
    bad = subprocess.run(run + ["--qtype", "Q8_0", "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "--load-format dummy" in bad.stderr       # no weights: says how
    rtn = ["--method", "rtn", "--model", "tiny", "--load-format", "dummy", "--out", str(tmp_path / "q")]
    bad = subprocess.run(run[:4] + rtn, capture_output=True, text=True)
    assert bad.returncode != 0 and "--load-format is for --method gguf" in bad.stderr


@pytest.mark.parametrize("factors", [[], [1.0, -2.0], "8", [True]])
def test_freq_factors_rope_must_be_positive_numbers(factors):
    with pytest.raises(ValueError, match="freq_factors"):
        ModelConfig.from_hf({**json.loads((model_path("tiny") / "config.json").read_text()),
                             "rope_parameters": None,
                             "rope_scaling": {"rope_type": "freq_factors", "freq_factors": factors}})
