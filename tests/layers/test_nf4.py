"""NF4: the levels from QLoRA's definition, blockwise absmax and double quantization against a
plain re-derivation, bitsandbytes-layout checkpoints written by hand (as transformers documents
them) loading into the engine, and the lookup path equal to its dense reference."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmopt.layers.quant.nf4 import NF4Weight, dynamic_map, from_bnb, nf4_levels, to_bnb
from llmopt.layers.quant.nf4 import NF4Linear

# The NF4 table as QLoRA's appendix E and bitsandbytes publish it
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def test_levels_are_the_normal_quantiles_of_the_definition():
    v = nf4_levels()
    assert torch.allclose(v, torch.tensor(PUBLISHED_NF4), atol=1e-6)
    assert v[7] == 0 and v[0] == -1 and v[-1] == 1 and (v > 0).sum() == 8 and (v < 0).sum() == 7
    # each positive level is a quantile of N(0, 1) at evenly spaced probabilities, scaled to 1
    p = torch.distributions.Normal(0, 1).cdf(v[8:].double() * torch.special.ndtri(torch.tensor(0.9677083).double()))
    assert torch.allclose(p, torch.linspace(0.9677083, 0.5, 9).double()[:-1].flip(0), atol=1e-6)


def test_dynamic_map_is_bitsandbytes_signed_code():
    code = dynamic_map()
    assert code.numel() == 256 and torch.equal(code, code.sort().values)
    assert code.max() == 1 and code.min() > -1 and (code == 0).sum() == 1
    assert abs(float(code[code > 0].min()) - 1e-6 * 0.55) < 1e-9   # the smallest step: 10^-6 x mid(0.1, 1)


def test_blockwise_codes_are_the_nearest_level_times_absmax():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 128, generator=g) * 0.02
    q = NF4Weight.quantize(w, blocksize=64)
    blocks = w.view(8, 2, 64)
    assert torch.equal(q.absmax, blocks.abs().amax(-1))
    levels = nf4_levels()
    nearest = (blocks[..., None] / q.absmax[..., None, None] - levels).abs().argmin(-1)
    assert torch.equal(q.codes.view(8, 2, 64).long(), nearest)
    want = levels[nearest] * q.absmax[..., None]
    assert torch.equal(q.dequantize(), want.view(8, 128))
    # every block's largest weight is exact (it maps to +-1)
    assert torch.allclose(q.dequantize().view(8, 2, 64).abs().amax(-1), q.absmax)


@pytest.mark.parametrize("double_quant", [True, False])
def test_bnb_tensors_round_trip_and_double_quant_matches_its_definition(double_quant):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 512, generator=g) * torch.linspace(0.01, 0.1, 96)[:, None]
    q = NF4Weight.quantize(w, 64, double_quant)
    t = to_bnb(q)
    assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (96 * 512 // 2, 1)
    first = q.codes.reshape(-1)[0::2]
    assert torch.equal(t["weight"].view(-1) >> 4, first)            # the first code in the high nibble
    state = json.loads(bytes(t["weight.quant_state.bitsandbytes__nf4"].tolist()))
    assert state["shape"] == [96, 512] and state["blocksize"] == 64 and state["quant_type"] == "nf4"
    codes, absmax, quant_map, blocksize, _ = from_bnb(t)
    assert torch.equal(codes, q.codes) and torch.equal(quant_map, nf4_levels()) and blocksize == 64
    if not double_quant:
        assert torch.equal(absmax, q.absmax.reshape(-1))
        return
    # double quantization: absmax - mean, 8 bits of the dynamic map per value, one fp32 scale per 256
    a = q.absmax.reshape(-1) - q.absmax.mean()
    scale = a.view(-1, 256).abs().amax(1)
    code = dynamic_map()
    idx = (a.view(-1, 256, 1) / scale[:, None, None] - code).abs().argmin(-1).reshape(-1)
    assert torch.equal(t["weight.absmax"].long(), idx) and torch.equal(t["weight.nested_absmax"], scale)
    want = code[idx] * scale.repeat_interleave(256) + state["nested_offset"]
    assert torch.equal(absmax.reshape(-1), want)
    assert (absmax - q.absmax.reshape(-1)).abs().max() < 0.01 * q.absmax.max()   # 8 bits keep absmax to ~1%
    stored = ("weight", "weight.absmax", "weight.nested_absmax")
    bits = sum(t[k].numel() * t[k].element_size() * 8 for k in stored) / w.numel()
    assert 4.12 < bits < 4.13                                        # 4 + 8/64 + 32/(64*256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_path_equals_its_dense_reference(dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 256, generator=g) * 0.05
    q = NF4Weight.quantize(w, 64)
    bias = torch.randn(48, generator=g)
    layer = NF4Linear.from_codes(q.codes, q.absmax, nf4_levels(), bias.to(dtype))
    x = torch.randn(3, 5, 256, generator=g).to(dtype)
    ref = torch.nn.functional.linear(x, q.dequantize().to(dtype), bias.to(dtype))
    assert torch.equal(layer(x), ref)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == 48 * 256 // 2


def bnb_checkpoint(dense_folder, out, double_quant=True, blocksize=64):
    """What transformers' bitsandbytes integration saves for an NF4 model, written from the
    definition with no llmopt code: per linear `weight` (packed codes) and its quant state."""
    shutil.copytree(dense_folder, out)
    sd = load_file(str(dense_folder / "model.safetensors"))
    levels, code = torch.tensor(PUBLISHED_NF4), dynamic_map()
    packed, dense = {}, {}
    for name, w in sd.items():
        if not name.endswith("_proj.weight"):
            packed[name] = dense[name] = w
            continue
        flat = w.float().reshape(-1, blocksize)
        absmax = flat.abs().amax(1)
        q = (flat[..., None] / absmax[:, None, None] - levels).abs().argmin(-1).reshape(-1)
        state = {"quant_type": "nf4", "absmax": None, "blocksize": blocksize, "quant_map": None,
                 "dtype": "bfloat16", "shape": list(w.shape)}
        base = name
        packed[base] = ((q[0::2] << 4) | q[1::2]).to(torch.uint8).view(-1, 1)
        packed[f"{base}.quant_map"] = levels.clone()
        if double_quant:
            offset = absmax.mean()
            a = torch.cat([absmax - offset, torch.zeros((-absmax.numel()) % 256)]).view(-1, 256)
            s2 = a.abs().amax(1)
            q2 = (a[..., None] / s2[:, None, None] - code).abs().argmin(-1).reshape(-1)[:absmax.numel()]
            packed[f"{base}.absmax"] = q2.to(torch.uint8)
            packed[f"{base}.nested_absmax"], packed[f"{base}.nested_quant_map"] = s2, code.clone()
            state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=offset.item())
            absmax = code[q2] * s2.repeat_interleave(256)[:absmax.numel()] + offset
        else:
            packed[f"{base}.absmax"] = absmax
        state = {k: v for k, v in state.items() if v is not None}
        packed[f"{base}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(state).encode()),
                                                                       dtype=torch.uint8)
        dense[name] = (levels[q].view(-1, blocksize) * absmax[:, None]).view(w.shape)
    save_file({k: v.contiguous() for k, v in packed.items()}, str(out / "model.safetensors"))
    dense_out = out.parent / (out.name + "-dense")
    shutil.copytree(dense_folder, dense_out)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(dense_out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                                  "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": double_quant,
                                  "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                                  "llm_int8_skip_modules": None}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, dense_out


@pytest.mark.parametrize("double_quant", [True, False])
def test_bitsandbytes_checkpoints_load_and_equal_their_dequantized_weights(checkpoint_dir, tmp_path,
                                                                           double_quant):
    from llmopt import LLM, SamplingParams
    from llmopt.model.loader import load_model

    qdir, ddir = bnb_checkpoint(checkpoint_dir("llama3"), tmp_path / "q", double_quant)
    qmodel, dmodel = load_model(qdir), load_model(ddir)
    assert isinstance(qmodel.model.layers[0].self_attn.qkv_proj, NF4Linear)
    for (n, p), (_, d) in zip(qmodel.named_modules(), dmodel.named_modules()):
        if isinstance(p, NF4Linear):
            assert torch.allclose(p.dequantize(), d.weight, rtol=0, atol=1e-7), n   # every shard in place
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["def f(x):", {"prompt_token_ids": [5, 17, 300, 2000]}]
    got = LLM(str(qdir), seed=0).generate(prompts, params, use_tqdm=False)
    want = LLM(str(ddir), seed=0).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_quantize_nf4_writes_a_checkpoint_the_engine_and_the_layout_agree_on(tmp_path):
    from llmopt import LLM, model_path
    from llmopt.model.loader import load_model
    from llmopt.quant import quantize

    r = quantize("tiny", method="nf4", group_size=64, double_quant=True, out=tmp_path / "nf4", progress=False)
    cfg = json.loads((r.path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "bitsandbytes" and cfg["bnb_4bit_quant_type"] == "nf4"
    assert 4.12 < r.linear_bytes * 8 / (r.fp16_linear_bytes / 2) < 4.25   # + 1 KiB of maps per shard
    sd = load_file(str(r.path / "model.safetensors"))
    assert "model.layers.0.self_attn.k_proj.weight.quant_state.bitsandbytes__nf4" in sd
    dense = load_model(model_path("tiny"))
    m = load_model(r.path)
    w, wq = dense.model.layers[0].mlp.down_proj.weight, m.model.layers[0].mlp.down_proj.dequantize()
    # within half NF4's widest step (1 - 0.696) of each block's absmax, plus 1% for its 8-bit storage
    err, absmax = (w - wq).reshape(-1, 64).abs().amax(1), w.reshape(-1, 64).abs().amax(1)
    assert torch.all(err <= (0.5 * 0.304 + 0.01) * absmax)
    LLM(str(r.path)).generate(["def f(x):"], use_tqdm=False)
    with pytest.raises(ValueError, match="double_quant"):
        quantize("tiny", method="rtn", double_quant=True, out=tmp_path / "x")
    with pytest.raises(ValueError, match="nf4"):
        quantize("tiny", method="nf4", bits=3, out=tmp_path / "y")


def test_command_line_writes_a_rotated_nf4_checkpoint(tmp_path, capsys):
    from llmopt import LLM
    from llmopt.cli import main

    out = tmp_path / "rot-nf4"
    assert main(["quantize", "--method", "nf4", "--model", "tiny", "--group-size", "64", "--rotation",
                 "hadamard", "--no-double-quant", "--out", str(out), "--no-progress"]) == 0
    assert "nf4 4-bit" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["bnb_4bit_use_double_quant"] is False
    assert cfg["quantization_config"]["meta"]["rotation"] == "hadamard" and cfg["tie_word_embeddings"] is False
    assert len(LLM(str(out)).generate(["def f(x):"], use_tqdm=False)[0].outputs[0].token_ids) > 0
