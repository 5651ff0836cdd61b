"""GGUF out (llmopt.quant.gguf_write, kquants) and GGUF blocks kept quantized (gguf_repack).

The reference reader is the `gguf` package (llama.cpp's own Python code): the bytes llmopt
writes must mean, to it, what llmopt meant; and llmopt's GGUF loader must read them back
into the model they came from."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

from llmopt.quant import kquants
from llmopt.quant.gguf_write import tensor_type, use_more_bits, write_gguf


def weights(rows=6, cols=512, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[0, :256] += 0.3       # a lopsided super-block: minima and scales differ by sub-block
    w[1, 256:] = 0          # an all-zero super-block
    return w


def test_q4_k_bytes_mean_what_the_definition_says():
    w = weights()
    data = kquants.quantize_q4_k(w)
    assert data.shape == (6, 2 * kquants.Q4_K_BYTES) and data.dtype == np.uint8
    d, dmin, sc, m, q = kquants.q4_k_integers(w)
    assert sc.max() <= 63 and m.max() <= 63 and q.max() <= 15
    mine = kquants.q4_k_dequantize_integers(d, dmin, sc, m, q).reshape(w.shape)
    assert np.array_equal(dequantize(data, T.Q4_K), mine)
    # and it is a quantization of w: within half a step (plus the 6-bit scale's rounding)
    step = (d[:, None] * sc).repeat(32, 1).reshape(w.shape)
    assert np.all(np.abs(mine - w) <= 0.5 * step + 2e-2 * np.abs(w).max())
    assert np.array_equal(dequantize(data, T.Q4_K)[1, 256:], np.zeros(256, np.float32))
    # about as good as llama.cpp's per-32 Q4_1 (which spends 16-bit scales per 32 weights)
    rms = lambda a: float(np.sqrt(np.mean((a - w) ** 2)))  # noqa: E731
    assert rms(mine) <= 1.5 * rms(dequantize(quantize(w, T.Q4_1), T.Q4_1))


def test_q6_k_bytes_mean_what_the_definition_says():
    w = weights(seed=1)
    data = kquants.quantize_q6_k(w)
    assert data.shape == (6, 2 * kquants.Q6_K_BYTES)
    d, sc, q = kquants.q6_k_integers(w)
    assert q.max() <= 63
    mine = kquants.q6_k_dequantize_integers(d, sc, q).reshape(w.shape)
    assert np.array_equal(dequantize(data, T.Q6_K), mine)
    assert np.abs(mine - w).max() <= np.abs(w).max() / 31 * 0.6
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize_q6_k(np.zeros((2, 320), np.float32))


def test_q4_k_m_mix_and_fallbacks_follow_llama_cpp():
    n = 30
    assert [i for i in range(n) if use_more_bits(i, n)][:5] == [0, 1, 2, 5, 8]
    assert tensor_type("blk.0.attn_v.weight", (192, 1536), "Q4_K_M", n) == "Q6_K"
    assert tensor_type("blk.3.attn_v.weight", (192, 1536), "Q4_K_M", n) == "Q4_K"
    assert tensor_type("blk.3.attn_q.weight", (576, 576), "Q4_K_M", n) == "Q5_0"   # 576 % 256
    assert tensor_type("blk.0.ffn_down.weight", (576, 576), "Q4_K_M", n) == "Q8_0"
    assert tensor_type("output.weight", (4096, 512), "Q4_K_M", n) == "Q6_K"
    assert tensor_type("blk.0.attn_norm.weight", (576,), "Q4_0", n) == "F32"
    assert tensor_type("blk.0.attn_q.weight", (64, 48), "Q8_0", n) == "F16"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf("tiny", q, folder / f"tiny-{q}.gguf") for q in ("F16", "Q8_0", "Q4_0", "Q4_K_M")}


def types_of(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def test_files_carry_types_config_and_tokenizer(written):
    r = GGUFReader(str(written["Q4_0"].path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in types                        # tiny ties its head to the embedding
    assert r.fields["llama.block_count"].contents() == 6
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert "<|im_start|>" in r.fields["tokenizer.chat_template"].contents()
    # rows of 384 / 640: Q4_K falls back to Q5_0, Q6_K to Q8_0 (attn_v / ffn_down where llama.cpp
    # gives more bits, and the tied embedding, which is also the output head)
    assert written["Q4_K_M"].tensor_types == {"F32": 13, "Q5_0": 38, "Q8_0": 5}
    assert types_of(written["Q4_K_M"].path)["token_embd.weight"] == "Q8_0"


def test_f16_round_trip_through_llmopts_loader_is_exact(written):
    """Read back (names mapped, Q / K rows permuted and unpermuted), the F16 file is the model
    rounded to float16, tensor for tensor and bit for bit."""
    from llmopt.model.loader import load_model
    from llmopt.model.registry import model_path

    a = load_model(model_path("tiny")).state_dict()
    b = load_model(written["F16"].path).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].half().float(), b[name]), name


def test_quantized_files_generate_and_tokenize_like_the_source(written):
    from llmopt import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    src = LLM("tiny", num_kv_blocks=64)
    want = src.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    q8 = LLM(str(written["Q8_0"].path), num_kv_blocks=64)
    got = q8.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got[:8] == want[:8]
    text = "def f(x):\n    return x  # <|im_end|> ok"
    assert q8.get_tokenizer()(text).input_ids == src.get_tokenizer()(text).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert q8.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        src.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_blocks_kept_quantized_match_the_dense_load(written, qtype):
    from llmopt.layers.quant.gguf_linear import GGUFLinear
    from llmopt.model.loader import load_model

    path = written[qtype].path
    dense = load_model(path, torch.float32)
    kept = load_model(path, torch.float32, quantization="gguf")
    blocks = {n: m for n, m in kept.named_modules() if isinstance(m, GGUFLinear)}
    assert len(blocks) == 6 * 4 + 1 and qtype in repr(blocks["lm_head"])
    for name, m in blocks.items():   # the file's blocks, nothing requantized: exactly the dense load
        assert torch.equal(m.dequantize(torch.float32), dense.get_submodule(name).weight), name


def test_cli_writes_a_gguf_file_and_rejects_flags_that_do_not_apply(tmp_path):
    out = tmp_path / "t.gguf"
    run = [sys.executable, "-m", "llmopt", "quantize", "--method", "gguf", "--model", "tiny", "--no-progress"]
    ok = subprocess.run(run + ["--qtype", "Q4_1", "--out", str(out)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "GGUF Q4_1" in ok.stdout and GGUFReader(str(out)).tensors
    bad = subprocess.run(run + ["--bits", "4", "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "--bits do not apply to --method gguf" in bad.stderr
    bad = subprocess.run(run + ["--out", str(tmp_path / "folder")], capture_output=True, text=True)
    assert bad.returncode != 0 and "out must name a .gguf file" in bad.stderr
