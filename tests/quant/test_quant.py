"""The quantizers: RTN's grid, GPTQ against RTN and its own invariants, AWQ's equivalence-
preserving scaling, and `quantize` end to end: checkpoints that load in the engine and
generate exactly what a dense model with the dequantized weights generates."""

import json

import pytest
import torch
from safetensors.torch import save_file

from llmopt import LLM, SamplingParams
from llmopt.quant import quantize
from llmopt.quant.gptq import GPTQ
from llmopt.quant.rtn import fake_quantize, quant_params, quantize_to_grid, rtn_quantize, search_params


def weight(n=48, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# -- RTN -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (4, 32, True), (3, 64, False), (8, -1, True),
                                            (2, 16, False)])
def test_rtn_grid(bits, group, sym):
    w = weight()
    q = rtn_quantize(w, bits, group, sym)
    G = w.shape[1] if group == -1 else group
    assert q.scales.shape == (w.shape[1] // G, w.shape[0]) and q.scales.dtype == torch.float16
    assert int(q.qweight.min()) >= 0 and int(q.qweight.max()) <= (1 << bits) - 1
    if sym:
        assert torch.all(q.zeros == 1 << (bits - 1))
    # every weight within half a step of its grid point (a hair more where fp16 rounding of the
    # scale moved the top of the grid below the group's max)
    step = q.scales.float()[q.g_idx.long()].t()
    assert torch.all((q.dequantize() - w).abs() <= 0.5 * step * 1.01 + (step if sym else 0) * 0.07)
    # a grid point rounds to itself: the codes are recovered from the dequantized weights
    zero = q.zeros[q.g_idx.long()].t()
    assert torch.equal(quantize_to_grid(q.dequantize(), step, zero, bits), q.qweight)


def test_rtn_keeps_zero_exact_and_zero_points_in_range():
    w = weight()
    w[:, :32] = w[:, :32].abs()  # a group with no negative weight: its zero point would be 0
    scale, zero = quant_params(w.view(48, 4, 32), 4, sym=False)
    assert torch.any(zero == 0)
    scale, zero = quant_params(w.view(48, 4, 32), 4, sym=False, min_zero=1)  # for the GPTQ v1 layout
    assert torch.all(zero >= 1)
    q = rtn_quantize(torch.zeros(4, 32), 4, 32, sym=False)  # an all-zero group stays zero
    assert torch.equal(q.dequantize(), torch.zeros(4, 32))


# -- GPTQ ------------------------------------------------------------------------------------------------
def correlated_inputs(k=128, tokens=2048, seed=1):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    scale = torch.linspace(0.2, 3.0, k)[torch.randperm(k, generator=g)]  # uneven channel sizes
    return (torch.randn(tokens, k, generator=g) @ mix) * scale


def output_error(w, w_hat, x):
    return ((x @ (w - w_hat).t()) ** 2).mean().item()


def test_gptq_equals_rtn_when_inputs_are_uncorrelated():
    """With H = c I nothing couples the columns: the error updates vanish and GPTQ is RTN."""
    w = weight()
    g = GPTQ(w)
    g.H = torch.eye(w.shape[1]) * 3.0
    for sym in (False, True):
        got = g.quantize(4, 32, sym=sym)
        want = rtn_quantize(w, 4, 32, sym)
        assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_beats_rtn_on_the_layer_output(desc_act):
    w, x = weight(), correlated_inputs()
    g = GPTQ(w)
    for chunk in x.split(512):
        g.add_batch(chunk)
    torch.testing.assert_close(g.H, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-4)
    gptq = g.quantize(4, 32, sym=False, desc_act=desc_act)
    rtn = rtn_quantize(w, 4, 32, sym=False)
    assert output_error(w, gptq.dequantize(), x) < 0.7 * output_error(w, rtn.dequantize(), x)


def test_act_order_groups_and_static_groups():
    w, x = weight(), correlated_inputs()
    g = GPTQ(w)
    g.add_batch(x)
    order = torch.argsort(torch.diag(g.H), descending=True)
    q = g.quantize(4, 32, sym=False, desc_act=True)
    # groups are runs of 32 columns in order of decreasing Hessian diagonal
    assert torch.equal(q.g_idx[order].long(), torch.arange(128) // 32)
    assert q.has_act_order
    s = g.quantize(4, 32, sym=False, desc_act=True, static_groups=True)
    assert torch.equal(s.g_idx.long(), torch.arange(128) // 32) and not s.has_act_order
    assert output_error(w, s.dequantize(), x) < output_error(w, rtn_quantize(w, 4, 32, False).dequantize(), x)


def test_the_grid_range_search_lowers_each_groups_error_and_gptq_takes_it():
    """search_params (GPTQ's `mse`): per group, the clipped range with the least sum |w - w_hat|^2.4;
    never worse than min..max (p = 1 is a candidate), and better for most groups of bell-shaped
    weights, whose few extreme values stretch min..max for all the others."""
    w = weight()
    groups = w.reshape(w.shape[0], -1, 32)

    def err(scale, zero):
        q = quantize_to_grid(groups, scale[..., None], zero[..., None], 4)
        return (groups - scale[..., None] * (q - zero[..., None])).abs().pow(2.4).sum(-1)

    plain, searched = err(*quant_params(groups, 4, False)), err(*search_params(groups, 4, False))
    assert torch.all(searched <= plain + 1e-9)
    assert (searched < plain).float().mean() > 0.5 and searched.sum() < 0.95 * plain.sum()
    x = correlated_inputs()
    g = GPTQ(w)
    g.add_batch(x)
    with_search = g.quantize(4, 32, sym=False, mse=2.4)
    assert not torch.equal(with_search.scales, g.quantize(4, 32, sym=False).scales)
    assert output_error(w, with_search.dequantize(), x) < output_error(w, rtn_quantize(w, 4, 32, False).dequantize(), x)


def test_gptq_ignores_dead_inputs():
    w, x = weight(), correlated_inputs()
    x[:, 5] = 0
    g = GPTQ(w)
    g.add_batch(x)
    assert torch.all(g.quantize(4, 32, sym=True).dequantize()[:, 5] == 0)


# -- AWQ -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("duo_scaling", [False, True])
def test_awq_scaling_keeps_the_function(checkpoint_dir, duo_scaling):
    from llmopt.model.loader import load_model
    from llmopt.quant.awq import awq_scale
    from llmopt.quant.calibration import BlockInputs

    for name in ("llama-tied", "qwen2"):  # GQA/MQA (v -> o skipped) and ...
        model = load_model(checkpoint_dir(name))
        windows = torch.randint(3, 4096, (4, 32), generator=torch.Generator().manual_seed(0))
        runner = BlockInputs(model, windows)
        layer = model.model.layers[0]
        inputs, before = runner.capture(layer, ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                "mlp.down_proj"])
        cfg = model.config
        qcfg = dict(bits=4, group_size=32, sym=False, min_zero=0)
        chosen = awq_scale(layer, inputs, lambda x: runner.attention(layer, x), qcfg, cfg.num_attention_heads,
                           cfg.num_key_value_heads, cfg.num_attention_heads * cfg.head_dim,
                           cfg.num_key_value_heads * cfg.head_dim, duo_scaling=duo_scaling)
        after = runner.run(layer)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
        for name, errors in chosen["errors"].items():
            if not duo_scaling:  # alpha = 0 is s = 1: plain RTN is one of the candidates
                assert errors[0.0] == pytest.approx(chosen["rtn_error"][name], rel=1e-5)
                assert min(errors.values()) <= chosen["rtn_error"][name]


def test_awq_scales_v_into_o_when_shapes_allow(tmp_path):
    """Without GQA the v -> o pair is scaled too, and the function still holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.model.loader import load_model
    from llmopt.quant.awq import awq_scale
    from llmopt.quant.calibration import BlockInputs

    cfg = AutoConfig.for_model("llama", vocab_size=4096, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    runner = BlockInputs(model, torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(0)))
    layer = model.model.layers[0]
    inputs, before = runner.capture(layer, ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                            "mlp.down_proj"])
    chosen = awq_scale(layer, inputs, lambda x: runner.attention(layer, x),
                       dict(bits=4, group_size=32, sym=False, min_zero=0), 4, 4, 64, 64)
    assert chosen["scales"]["o_proj"] is not None
    torch.testing.assert_close(runner.run(layer), before, rtol=1e-4, atol=1e-5)


def test_awq_clip_only_shrinks_and_lowers_each_groups_error():
    from llmopt.quant.awq import apply_clip, search_clip

    w, x = weight(), correlated_inputs()
    q = dict(bits=3, group_size=32, sym=False, min_zero=0)
    max_val = search_clip(w, x, q, 32)
    original = w.abs().view(48, 4, 32).amax(-1)
    assert torch.all(max_val <= original) and torch.any(max_val < original)
    # on the tokens it searched, every (row, group) partial output is no worse than unclipped
    xs = x[::4].view(-1, 4, 32)

    def group_errors(w_hat):
        diff = (w_hat - w).view(48, 4, 32)
        return torch.einsum("tgj,rgj->rtg", xs, diff).pow(2).mean(1)

    clipped = fake_quantize(apply_clip(w, max_val), **q)
    assert torch.all(group_errors(clipped) <= group_errors(fake_quantize(w, **q)) * (1 + 1e-5))


# -- quantize() end to end --------------------------------------------------------------------------------
def dense_copy(qfolder, out):
    """The quantized checkpoint's numbers as a plain dense checkpoint (dequantized weights)."""
    import shutil

    from llmopt.model.loader import load_model
    from llmopt.quant.checkpoint import checkpoint_shards

    model = load_model(qfolder)
    shutil.copytree(qfolder, out)
    tensors = {}
    for pname, p in model.named_parameters():
        module_name, _, leaf = pname.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, "dequantize") and leaf != "bias":
            if leaf not in ("qweight", "weight"):
                continue  # qzeros, scales, g_idx: folded into the dequantized weight
            p, pname = module.dequantize(), f"{module_name}.weight"
        if pname == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for ckpt, rows in checkpoint_shards(model, pname):
            tensors[ckpt] = (p if rows is None else p[rows[0]:rows[1]]).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("kw", [dict(method="rtn", bits=4, group_size=32, sym=False),
                                dict(method="rtn", bits=8, group_size=-1),
                                dict(method="gptq", bits=4, group_size=32, desc_act=True),
                                dict(method="gptq", bits=3, group_size=32, sym=False, static_groups=True,
                                     desc_act=True),
                                dict(method="awq", bits=4, group_size=32),
                                dict(method="awq", bits=3, group_size=32, format="gptq")])
def test_quantized_checkpoints_generate_like_their_dequantized_weights(checkpoint_dir, tmp_path, kw):
    src = checkpoint_dir("llama3")   # GQA, untied head, biases on attention and MLP
    calib = {} if kw["method"] == "rtn" else dict(num_samples=4, seq_len=64)
    r = quantize(str(src), out=tmp_path / "q", progress=False, **kw, **calib)
    cfg = json.loads((r.path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == r.format and cfg["bits"] == kw["bits"] and cfg["group_size"] == kw["group_size"]
    if r.format == "gptq":
        assert cfg["desc_act"] == kw.get("desc_act", False) and cfg["checkpoint_format"] == "gptq"
    else:
        assert cfg["version"] == "gemm" and cfg["zero_point"] is True
    dense = dense_copy(r.path, tmp_path / "dense")
    prompts = ["def f(x):", {"prompt_token_ids": [9, 99, 999, 3000, 12]}]
    got = LLM(str(r.path)).generate(prompts, GREEDY, use_tqdm=False)
    want = LLM(str(dense)).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_tiny_gptq_act_order_checkpoint(tmp_path):
    """The bundled model through GPTQ with act-order: non-monotonic g_idx on disk, under 30%
    of fp16's bytes, loads in LLM and generates what its dequantized weights generate."""
    from safetensors import safe_open

    r = quantize("tiny", "gptq", 4, 128, tmp_path / "q", num_samples=2, seq_len=128, desc_act=True,
                 sym=False, progress=False)
    assert r.linear_bytes_ratio <= 0.30 and r.num_calibration_tokens == 256
    with safe_open(str(r.path / "model.safetensors"), "pt") as f:
        g_idx = f.get_tensor("model.layers.0.mlp.down_proj.g_idx")
        assert f.get_tensor("model.layers.0.self_attn.q_proj.qweight").dtype == torch.int32
    assert g_idx.shape == (640,) and not torch.equal(g_idx.long(), torch.arange(640) // 128)
    assert torch.equal(torch.bincount(g_idx.long()), torch.full((5,), 128))
    dense = dense_copy(r.path, tmp_path / "dense")
    got = LLM(str(r.path)).generate(["def fibonacci(n):"], GREEDY, use_tqdm=False)
    want = LLM(str(dense)).generate(["def fibonacci(n):"], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_calibration_split_is_not_the_evaluation_text():
    from transformers import AutoTokenizer

    from llmopt import model_path
    from llmopt.eval import heldout_text
    from llmopt.quant.calibration import calibration_windows

    tok = AutoTokenizer.from_pretrained(model_path("tiny"))
    w = calibration_windows(tok, None, 4, 256, 4096)
    assert w.shape == (4, 256)
    assert tok.decode(w[0, 1:40]) in heldout_text("calibration")
    assert tok.decode(w[0, 1:40]) not in heldout_text("eval")


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="spqr"), "method must be one of"),
    (dict(method="gptq", bits=5), "bits must be one of"),
    (dict(method="awq", bits=3), "format='gptq'"),
    (dict(method="rtn", group_size=0), "group_size must be -1"),
    (dict(method="rtn", group_size=100), "does not divide"),
    (dict(method="rtn", group_size=48), "does not divide"),
    (dict(method="gptq", calibration=""), "empty"),
    (dict(method="gptq", calibration=[]), "not empty"),
    (dict(method="awq", calibration="def f(x):\n    return x\n"), "too short"),
    (dict(method="gptq", calibration=[[1, 2, 99999]]), r"\[0, 4096\)"),
    (dict(method="gptq", num_samples=0), "num_samples"),
    (dict(method="gptq", seq_len=4096), "max_position_embeddings"),
    (dict(method="gptq", damp_percent=1.5), "damp_percent"),
    (dict(method="gptq", mse=-1), "mse"),
    (dict(method="rtn", mse=2.4), "mse is an option of method='gptq'"),
    (dict(method="rtn", calibration="text"), "no calibration"),
    (dict(method="awq", desc_act=True), "desc_act is an option of method='gptq'"),
    (dict(method="gptq", zero_point=False), "zero_point is an option of method='awq'"),
    (dict(method="awq", sym=True), "zero_point=False"),
    (dict(method="awq", version="GEMV"), "GEMM"),
    (dict(method="rtn", format="exl2"), "format must be"),
    (dict(method="gptq", format="awq", desc_act=True), "g_idx"),
    (dict(method="fp8", bits=4), "fp8"),
    (dict(method="rtn", out=None), "out must name"),
])
def test_bad_arguments_fail_before_work(tmp_path, kwargs, match):
    kwargs.setdefault("out", tmp_path / "q")
    with pytest.raises(ValueError, match=match):
        quantize("tiny", progress=False, **kwargs)
    assert not (tmp_path / "q").exists()


def test_refuses_quantized_models_and_occupied_folders(tmp_path):
    r = quantize("tiny", "rtn", 4, 128, tmp_path / "q", progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize(str(r.path), "rtn", out=tmp_path / "q2", progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        quantize("tiny", "rtn", out=tmp_path / "busy", progress=False)
    quantize("tiny", "rtn", 4, 32, r.path, progress=False)  # an earlier checkpoint may be overwritten


def test_cli_quantize(tmp_path, capsys):
    from llmopt.cli import main

    assert main(["quantize", "--method", "rtn", "--model", "tiny", "--bits", "4", "--group-size", "128",
                 "--out", str(tmp_path / "q"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "q") in printed and "of fp16" in printed
    assert LLM(str(tmp_path / "q")).generate("def ", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert main(["quantize", "--method", "gptq", "--bits", "5", "--out", str(tmp_path / "x")]) == 2
    assert "bits must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("method, change, match", [
    # each loaded and generated token 0 (NaN / inf) or garbage (a negative or truncated int scale)
    ("gptq", ("scales", lambda t: t.clone().fill_(float("nan"))), "q_proj.scales' holds NaN or infinite"),
    ("gptq", ("scales", lambda t: t.to(torch.int32)), "q_proj.scales' is torch.int32; scales must be a float"),
    ("awq", ("scales", lambda t: t.clone().fill_(float("inf"))), "q_proj.scales' holds NaN or infinite"),
    ("fp8", ("weight_scale", lambda t: -t), "q_proj.weight_scale' holds negative values"),
    ("fp8", ("weight_scale", lambda t: t.to(torch.int32)), "weight_scale must be a float"),
    ("fp8", ("weight", lambda t: t.view(torch.uint8).clone().fill_(0x7F).view(t.dtype)), "q_proj.weight' holds NaN"),
    # a string was split into letters that matched every layer; a number was a TypeError
    ("awq", {"modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list of module names"),
    ("awq", {"modules_to_not_convert": [1]}, "modules_to_not_convert must be a list of module names"),
    ("fp8", {"ignored_layers": "lm_head"}, "ignored_layers must be a list of module names"),
])
def test_corrupt_quantized_checkpoints_are_named(tmp_path, method, change, match):
    from safetensors.torch import load_file

    from llmopt.model.loader import load_model

    kw = dict(method="fp8") if method == "fp8" else dict(method="rtn", bits=4, group_size=128, format=method)
    path = quantize("tiny", out=tmp_path / "q", progress=False, **kw).path
    if isinstance(change, dict):
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"].update(change)
        (path / "config.json").write_text(json.dumps(cfg))
    else:
        leaf, how = change
        tensors = load_file(path / "model.safetensors")
        name = f"model.layers.0.self_attn.q_proj.{leaf}"
        tensors[name] = how(tensors[name])
        save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        load_model(path)
