"""FP8 and int8 weights: quantize-on-load, FP8 checkpoints as llm-compressor / vLLM write them
(float8_e4m3fn weight, fp32 weight_scale, optional input_scale), save/load round trips, and
the CPU emulation doing the native FP8 matmul's math."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmopt import LLM, SamplingParams, model_path
from llmopt.fp8.format import dequantize_fp8, native_fp8_supported, quantize_fp8, quantize_fp8_per_token
from llmopt.fp8.linear import Fp8Linear
from llmopt.layers.quant.int8 import Int8Linear
from llmopt.model.loader import load_model
from llmopt.quant import quantize

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def linear(n=96, k=64, bias=True, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        m.weight[3, 7] = 2.0  # one large weight: its row's scale is larger than the others'
    return m


def test_fp8_linear_is_quantize_dequantize_matmul():
    """Dynamic per-token activation scales, per-channel weight scales: the W8A8 emulation equals
    the textbook computation (dequantize both, multiply) up to fp32 summation order; without
    FP8 units (this CPU) the layer is weight-only: the activations multiply the widened weights."""
    lin = linear()
    m = Fp8Linear.from_linear(lin)
    assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.shape == (96, 1)
    x = torch.randn(5, 64) * torch.logspace(-2, 1, 5)[:, None]  # tokens of very different sizes
    weights = dequantize_fp8(m.weight, m.weight_scale)
    torch.testing.assert_close(m(x), x @ weights.t() + lin.bias, rtol=1e-5, atol=1e-6)
    m.quantize_activations = True
    xq, xs = quantize_fp8_per_token(x)
    want = dequantize_fp8(xq, xs) @ weights.t() + lin.bias
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(m(x), x @ weights.t() + lin.bias, rtol=1e-3)   # the activations were rounded
    # and it is close to the full-precision layer: e4m3 keeps 3 mantissa bits
    err = (m(x) - lin(x)).abs().max() / lin(x).abs().max()
    assert err < 0.05
    # weights: each within half an fp8 step of the original (relative 2^-4 for normal values)
    w = m.dequantize()
    big = lin.weight.abs() > 2 ** -6 * m.weight_scale
    assert torch.all(((w - lin.weight).abs() / lin.weight.abs())[big] <= 2 ** -4 + 1e-6)


def test_fp8_linear_static_input_scale():
    m = Fp8Linear(64, 32, bias=False, static_input_scale=True)
    m.quantize_activations = True   # a static input scale is W8A8's; weight-only has no use for it
    ref = Fp8Linear.from_linear(linear(32, 64, bias=False))
    m.load_checkpoint_tensor("weight", ref.weight.data, None, "weight")
    m.load_checkpoint_tensor("weight_scale", ref.weight_scale.data, None, "weight_scale")
    m.load_checkpoint_tensor("input_scale", torch.tensor(0.01), None, "input_scale")
    x = torch.randn(3, 64)
    xq = quantize_fp8(x, 0.01)  # one scale for every token, clamped at +-448 * 0.01
    want = dequantize_fp8(xq, 0.01) @ ref.dequantize().t()
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not native_fp8_supported(), reason="needs a CUDA GPU with compute capability >= 8.9")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_fp8_matmul_equals_the_emulation(dtype):
    m = Fp8Linear.from_linear(linear(256, 128)).cuda()
    x = torch.randn(33, 128, device="cuda").to(dtype)
    xq, xs = quantize_fp8_per_token(x.reshape(-1, 128))
    native = m._native(xq, xs, dtype)
    emulated = m._emulated(xq, xs)
    torch.testing.assert_close(native, emulated, rtol=1e-2, atol=1e-2 * emulated.abs().max().item())


def test_int8_linear_per_channel_rtn():
    lin = linear()
    m = Int8Linear.from_linear(lin)
    assert m.weight.dtype == torch.int8 and int(m.weight.abs().max()) == 127
    torch.testing.assert_close(m.weight_scale, lin.weight.abs().amax(1) / 127)
    assert torch.all((m.dequantize() - lin.weight).abs() <= m.weight_scale[:, None] / 2 + 1e-7)
    x = torch.randn(4, 64)
    assert torch.equal(m(x), F.linear(x, m.dequantize(), lin.bias))


@pytest.mark.parametrize("method,cls", [("int8", Int8Linear), ("fp8", Fp8Linear)])
def test_quantize_on_load_equals_its_dequantized_weights(method, cls):
    """LLM(quantization=...) swaps every decoder linear; the model computes what a dense model
    holding the dequantized weights computes (int8: exactly; fp8 weight-only here, as on any
    device without FP8 units: up to fp32 summation order)."""
    model = load_model(model_path("tiny"), quantization=method)
    names = model.quantizable_linears()
    assert len(names) == 4 * 6 and all(isinstance(model.get_submodule(n), cls) for n in names)
    assert isinstance(model.lm_head, torch.nn.Linear)  # tied to the embedding, kept dense
    dense = load_model(model_path("tiny"))
    for n in names:
        lin = dense.get_submodule(n)
        lin.weight.data = model.get_submodule(n).dequantize()
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.model.forward import run_model
    from llmopt.worker.kv_cache import NoKVCache

    ids = torch.randint(3, 4096, (40,), generator=torch.Generator().manual_seed(0))
    got = model.compute_logits(run_model(model, NoKVCache(), ids, AttentionMetadata.uncached([40])))
    want = dense.compute_logits(run_model(dense, NoKVCache(), ids, AttentionMetadata.uncached([40])))
    if method == "int8":
        assert torch.equal(got, want)
    else:  # (x . q) s per output channel against x . (q s)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_llm_quantization_argument(tmp_path):
    full = LLM("tiny").generate(["def fibonacci(n):"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for method in ("int8", "fp8"):
        out = LLM("tiny", quantization=method).generate(["def fibonacci(n):"], GREEDY, use_tqdm=False)
        # 8-bit weights barely move the bundled model: most greedy tokens agree
        same = sum(a == b for a, b in zip(out[0].outputs[0].token_ids, full))
        assert same >= len(full) // 2
    with pytest.raises(ValueError, match="quantization must be None, 'fp8' or 'int8'"):
        LLM("tiny", quantization="int4")
    gptq = quantize("tiny", "rtn", 4, 128, tmp_path / "q", progress=False)
    with pytest.raises(ValueError, match="quantization='fp8', but .* is a 'gptq' checkpoint"):
        LLM(str(gptq.path), quantization="fp8")


def test_fp8_checkpoint_round_trip(tmp_path):
    r = quantize("tiny", "fp8", out=tmp_path / "fp8", progress=False)
    cfg = json.loads((r.path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "fp8" and cfg["activation_scheme"] == "dynamic"
    with safe_open(str(r.path / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale")
        assert "model.layers.0.self_attn.k_proj.input_scale" not in f.keys()
    assert w.dtype == torch.float8_e4m3fn and w.shape == (128, 384)
    assert s.dtype == torch.float32 and s.shape == (128, 1)
    assert r.linear_bytes_ratio < 0.51  # one byte a weight, plus a scale per row
    # the saved checkpoint is the quantize-on-load model: same weights, same tokens
    loaded, on_load = load_model(r.path), load_model(model_path("tiny"), quantization="fp8")
    for n in loaded.quantizable_linears():
        a, b = loaded.get_submodule(n), on_load.get_submodule(n)
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.weight_scale, b.weight_scale)
    got = LLM(str(r.path)).generate(["class Stack:"], GREEDY, use_tqdm=False)
    want = LLM("tiny", quantization="fp8").generate(["class Stack:"], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def compressor_style_checkpoint(dense_folder, out, config):
    """An FP8 checkpoint written the way llm-compressor / AutoFP8 do, independently of llmopt:
    one per-tensor weight scale for each of q/k/v (they differ), and a static input_scale."""
    shutil.copytree(dense_folder, out)
    sd = load_file(str(dense_folder / "model.safetensors"))
    fmax = torch.finfo(torch.float8_e4m3fn).max
    tensors = {}
    for name, t in sd.items():
        if name.endswith("_proj.weight"):
            scale = t.float().abs().max() / fmax
            tensors[name] = (t.float() / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
            tensors[name + "_scale"] = scale.reshape(())
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.02 + 0.01 * (len(tensors) % 3))
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(cfg))
    return out, tensors


@pytest.mark.parametrize("config", [
    {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
     "config_groups": {"group_0": {"targets": ["Linear"],
                                   "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                               "symmetric": True, "dynamic": False},
                                   "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "symmetric": True, "dynamic": False}}}},
])
def test_fp8_checkpoints_made_elsewhere_load(checkpoint_dir, tmp_path, config):
    folder, tensors = compressor_style_checkpoint(checkpoint_dir("llama3"), tmp_path / "fp8", config)
    model = load_model(folder)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.input_scale is not None
    parts = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    # per-tensor scales of the shards land on their rows; the fused layer's input scale is their max
    want = torch.cat([dequantize_fp8(tensors[p + ".weight"], tensors[p + ".weight_scale"]) for p in parts])
    assert torch.equal(qkv.dequantize(), want)
    assert float(qkv.input_scale) == max(float(tensors[p + ".input_scale"]) for p in parts)
    out = LLM(str(folder)).generate(["def f(x):"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 24


def test_bad_fp8_checkpoints(checkpoint_dir, tmp_path):
    folder, tensors = compressor_style_checkpoint(
        checkpoint_dir("llama-tied"), tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "static"})
    key = "model.layers.0.mlp.down_proj"
    bad = dict(tensors)
    bad[key + ".weight"] = bad[key + ".weight"].float().to(torch.float8_e5m2)
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        load_model(folder)
    bad = dict(tensors)
    bad[key + ".input_scale"] = torch.ones(4)
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="one number"):
        load_model(folder)
    bad = dict(tensors)
    del bad[key + ".input_scale"]
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        load_model(folder)
