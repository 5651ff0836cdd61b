"""The GPTQ v1 and AWQ GEMM layouts: our packing and unpacking against reference packers
written here from the tools' documented layouts (loops over words and nibbles, the way
AutoGPTQ's QuantLinear.pack and AutoAWQ's WQLinear_GEMM.from_linear spell them), and
checkpoints packed by those references loading in the engine."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmopt.kernels.quant_matmul import AWQ_PACK_ORDER, awq_dequantize, awq_unpack, gptq_dequantize, unpack
from llmopt.layers.quant.awq import pack_awq, to_awq
from llmopt.layers.quant.formats import QuantizedWeight, QuantScheme, pack
from llmopt.layers.quant.gptq import to_gptq


# -- reference packers (independent of llmopt) ----------------------------------------------------------
def ref_pack_gptq_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qweight packing: [K, N] values -> [K*bits/32, N] words, along K."""
    iw = intweight.astype(np.uint64)
    q = np.zeros((iw.shape[0] * bits // 32, iw.shape[1]), dtype=np.uint64)
    i = row = 0
    while row < q.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                q[row] |= iw[j] << np.uint64(bits * (j - i))
            i += 32 // bits
            row += 1
        else:  # bits == 3: 32 values in 3 words, two of them split across a word boundary
            for j in range(i, i + 10):
                q[row] |= iw[j] << np.uint64(3 * (j - i))
            i += 10
            q[row] |= (iw[i] << np.uint64(30)) & np.uint64(0xFFFFFFFF)
            row += 1
            q[row] |= (iw[i] >> np.uint64(2)) & np.uint64(1)
            i += 1
            for j in range(i, i + 10):
                q[row] |= iw[j] << np.uint64(3 * (j - i) + 1)
            i += 10
            q[row] |= (iw[i] << np.uint64(31)) & np.uint64(0xFFFFFFFF)
            row += 1
            q[row] |= (iw[i] >> np.uint64(1)) & np.uint64(3)
            i += 1
            for j in range(i, i + 10):
                q[row] |= iw[j] << np.uint64(3 * (j - i) + 2)
            i += 10
            row += 1
    return (q & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def ref_pack_gptq_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qzeros packing: [G, N] values -> [G, N*bits/32], along N (the same bit stream)."""
    return ref_pack_gptq_rows(values.T, bits).T.copy()


def ref_pack_awq(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ GEMM: [rows, N] 4-bit values -> [rows, N/8]; nibble i holds column order_map[i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    iw = intweight.astype(np.uint64)
    q = np.zeros((iw.shape[0], iw.shape[1] // 8), dtype=np.uint64)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            q[:, col] |= iw[:, col * 8 + order_map[i]] << np.uint64(i * 4)
    return q.astype(np.uint32).view(np.int32)


def ref_dequant(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """W [K, N] = scale[g] * (q - zero[g]), in float32."""
    return (q.astype(np.float32) - zeros[g_idx].astype(np.float32)) * scales[g_idx].astype(np.float32)


def random_quantized(K, N, bits, group, seed=0, act_order=False) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    maxq = (1 << bits) - 1
    G = K if group == -1 else group
    g_idx = torch.arange(K) // G
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    return QuantizedWeight(torch.randint(0, maxq + 1, (N, K), generator=g, dtype=torch.int32),
                           (torch.rand(K // G, N, generator=g) * 0.02 + 1e-3).half(),
                           torch.randint(1, maxq + 1, (K // G, N), generator=g, dtype=torch.int32),
                           g_idx.int(), bits, group)


# -- packing equals the references ----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_packing_matches_reference(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (64, 96), generator=g)
    want_rows = ref_pack_gptq_rows(values.numpy(), bits)
    want_cols = ref_pack_gptq_cols(values.numpy(), bits)
    assert np.array_equal(pack(values, bits, dim=0).numpy(), want_rows)
    assert np.array_equal(pack(values, bits, dim=1).numpy(), want_cols)
    # and our unpack reads the reference's words back
    assert torch.equal(unpack(torch.from_numpy(want_rows), bits, dim=0), values.int())
    assert torch.equal(unpack(torch.from_numpy(want_cols), bits, dim=1), values.int())


def test_awq_packing_matches_reference():
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (40, 64), generator=g)
    want = ref_pack_awq(values.numpy())
    assert np.array_equal(pack_awq(values).numpy(), want)
    assert torch.equal(awq_unpack(torch.from_numpy(want)), values.int())
    # one word spelled out: columns 0..7 holding the values 0..7 sit in nibbles 0,2,4,6,1,3,5,7
    word = pack_awq(torch.arange(8)[None])[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_PACK_ORDER)


@pytest.mark.parametrize("bits,group,act_order", [(4, 32, False), (4, 32, True), (3, 64, True),
                                                  (8, -1, False), (2, 16, False)])
def test_to_gptq_is_the_reference_layout(bits, group, act_order):
    w = random_quantized(128, 64, bits, group, act_order=act_order)
    t = to_gptq(w)
    maxq = (1 << bits) - 1
    assert np.array_equal(t["qweight"].numpy(), ref_pack_gptq_rows(w.qweight.t().numpy(), bits))
    # v1 stores zero - 1
    assert np.array_equal(t["qzeros"].numpy(), ref_pack_gptq_cols(((w.zeros - 1) & maxq).numpy(), bits))
    assert t["scales"].dtype == torch.float16 and t["g_idx"].dtype == torch.int32
    assert torch.equal(t["g_idx"], w.g_idx)
    want = ref_dequant(w.qweight.t().numpy(), w.zeros.numpy(), w.scales.numpy(), w.g_idx.long().numpy())
    got = gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(w.dequantize(), got.t())


def test_to_awq_is_the_reference_layout():
    w = random_quantized(128, 64, 4, 32)
    w.zeros[0, 0] = 0  # AWQ stores zeros as they are: 0 is fine here
    t = to_awq(w)
    assert np.array_equal(t["qweight"].numpy(), ref_pack_awq(w.qweight.t().numpy()))
    assert np.array_equal(t["qzeros"].numpy(), ref_pack_awq(w.zeros.numpy()))
    got = awq_dequantize(t["qweight"], t["qzeros"], t["scales"], 32)
    assert torch.equal(got.t(), w.dequantize())


def test_layouts_refuse_what_they_cannot_store():
    w = random_quantized(64, 32, 4, 32)
    w.zeros[0, 0] = 0
    with pytest.raises(ValueError, match="zero - 1"):
        to_gptq(w)
    with pytest.raises(ValueError, match="4-bit"):
        to_awq(random_quantized(64, 32, 3, 32))
    with pytest.raises(ValueError, match="g_idx"):
        to_awq(random_quantized(64, 32, 4, 32, act_order=True))
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        pack(torch.tensor([[16] * 8]), 4, dim=1)
    with pytest.raises(ValueError, match="whole int32"):
        pack(torch.zeros(1, 7, dtype=torch.long), 4, dim=1)


# -- quantization_config ----------------------------------------------------------------------------------
def test_scheme_reads_the_tools_configs():
    s = QuantScheme.from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
                                 "sym": True, "damp_percent": 0.01, "checkpoint_format": "gptq"})
    assert (s.method, s.bits, s.group_size, s.desc_act, s.sym) == ("gptq", 4, 128, True, True)
    s = QuantScheme.from_config({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                 "version": "GEMM", "modules_to_not_convert": ["mlp.down_proj"]})
    assert (s.method, s.group_size, s.sym) == ("awq", 64, False)
    assert s.converts(["model.layers.0.self_attn.q_proj"]) and not s.converts(["model.layers.3.mlp.down_proj"])
    s = QuantScheme.from_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "gemm"})
    assert (s.bits, s.group_size) == (4, 128)


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "gptq", "bits": 5, "group_size": 128}, "bits=5"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
    ({"quant_method": "gptq", "bits": 4}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, "4-bit"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "4-bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}, "uint8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme"),
    ("gptq", "object"),
])
def test_scheme_rejects_what_llmopt_does_not_run(config, match):
    with pytest.raises(ValueError, match=match):
        QuantScheme.from_config(config)


# -- checkpoints packed by the references load in the engine --------------------------------------------
def hub_style_checkpoint(dense_folder, out, layout, bits=4, group=32, act_order=False):
    """Quantize a dense HF checkpoint with plain RTN and pack it with the reference packers,
    the way a checkpoint made by another tool would arrive. Also writes the dequantized
    weights as a dense checkpoint (out/../name-dense) with the same numbers."""
    shutil.copytree(dense_folder, out)
    dense_out = out.parent / (out.name + "-dense")
    shutil.copytree(dense_folder, dense_out)
    sd = load_file(str(dense_folder / "model.safetensors"))
    maxq = (1 << bits) - 1
    packed, dense = {}, {}
    for name, w in sd.items():
        if not name.endswith("_proj.weight"):
            packed[name] = dense[name] = w
            continue
        N, K = w.shape
        G = K if group == -1 else group
        g_idx = torch.arange(K) // G
        if act_order:  # one order per input: q/k/v (and gate/up) see the same Hessian, hence share it
            layer_input = name.rsplit(".", 2)[0] + ("" if "o_proj" in name or "down" in name else "-in")
            perm = torch.randperm(K, generator=torch.Generator().manual_seed(sum(map(ord, layer_input))))
            g_idx = g_idx[perm]
        scales = torch.zeros(K // G, N)
        zeros = torch.zeros(K // G, N, dtype=torch.int64)
        for j in range(K // G):
            cols = w[:, g_idx == j].float()
            lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
            scales[j] = ((hi - lo) / maxq).half().float()
            zeros[j] = torch.round(-lo / scales[j]).clamp(1, maxq).long()
        q = torch.clamp(torch.round(w.float().t() / scales[g_idx]) + zeros[g_idx], 0, maxq).long()  # [K, N]
        base = name[:-len(".weight")]
        if layout == "gptq":
            packed[f"{base}.qweight"] = torch.from_numpy(ref_pack_gptq_rows(q.numpy(), bits))
            packed[f"{base}.qzeros"] = torch.from_numpy(ref_pack_gptq_cols((zeros - 1).numpy(), bits))
            packed[f"{base}.g_idx"] = g_idx.int()
        else:
            packed[f"{base}.qweight"] = torch.from_numpy(ref_pack_awq(q.numpy()))
            packed[f"{base}.qzeros"] = torch.from_numpy(ref_pack_awq(zeros.numpy()))
        packed[f"{base}.scales"] = scales.half()
        dense[name] = torch.from_numpy(ref_dequant(q.numpy(), zeros.numpy(), scales.numpy(), g_idx.numpy())).t()
    save_file({k: v.contiguous() for k, v in packed.items()}, str(out / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in dense.items()}, str(dense_out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
         "checkpoint_format": "gptq"} if layout == "gptq" else
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out, dense_out


@pytest.mark.parametrize("layout,bits,act_order", [("gptq", 4, True), ("gptq", 3, False), ("awq", 4, False)])
@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_hub_checkpoints_load_and_equal_their_dequantized_weights(checkpoint_dir, tmp_path, layout, bits,
                                                                   act_order, name):
    from llmopt import LLM, SamplingParams
    from llmopt.layers.quant.awq import AWQLinear
    from llmopt.layers.quant.gptq import GPTQLinear
    from llmopt.model.loader import load_model

    qdir, ddir = hub_style_checkpoint(checkpoint_dir(name), tmp_path / "q", layout, bits, 32, act_order)
    qmodel, dmodel = load_model(qdir), load_model(ddir)
    cls = GPTQLinear if layout == "gptq" else AWQLinear
    assert isinstance(qmodel.model.layers[0].self_attn.qkv_proj, cls)
    assert qmodel.model.layers[0].self_attn.qkv_proj.act_order is act_order if layout == "gptq" else True
    for (n, p), (_, d) in zip(qmodel.named_modules(), dmodel.named_modules()):
        if isinstance(p, cls):
            assert torch.equal(p.dequantize(), d.weight), n   # every shard in its place
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["def f(x):", {"prompt_token_ids": [5, 17, 300, 2000]}]
    got = LLM(str(qdir), seed=0).generate(prompts, params, use_tqdm=False)
    want = LLM(str(ddir), seed=0).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_corrupt_or_mismatched_checkpoints_are_rejected(checkpoint_dir, tmp_path):
    from llmopt.model.loader import load_model

    qdir, _ = hub_style_checkpoint(checkpoint_dir("llama3"), tmp_path / "q", "gptq", 4, 32, True)
    sd = load_file(str(qdir / "model.safetensors"))

    def variant(tag, edit=None, config=None):
        d = tmp_path / tag
        shutil.copytree(qdir, d)
        if edit is not None:
            t = dict(sd)
            edit(t)
            save_file(t, str(d / "model.safetensors"))
        if config is not None:
            cfg = json.loads((d / "config.json").read_text())
            cfg["quantization_config"].update(config)
            (d / "config.json").write_text(json.dumps(cfg))
        return d

    key = "model.layers.0.self_attn.k_proj"
    cases = [
        (variant("shape", lambda t: t.__setitem__(f"{key}.qweight", t[f"{key}.qweight"][:-1])), "shape"),
        (variant("dtype", lambda t: t.__setitem__(f"{key}.qweight", t[f"{key}.qweight"].float())), "dtype"),
        (variant("missing", lambda t: t.pop(f"{key}.scales")), "lacks"),
        (variant("gidx-range", lambda t: t.__setitem__(f"{key}.g_idx", t[f"{key}.g_idx"] + 100)), "g_idx"),
        (variant("gidx-differs", lambda t: t.__setitem__(f"{key}.g_idx", t[f"{key}.g_idx"].flip(0))), "share"),
        (variant("bits", config={"bits": 8}), "shape"),        # the config does not match the tensors
        (variant("group", config={"group_size": 48}), "group_size"),
    ]
    for folder, match in cases:
        with pytest.raises(ValueError, match=match):
            load_model(folder)
    (tmp_path / "corrupt").mkdir()
    shutil.copy(qdir / "config.json", tmp_path / "corrupt" / "config.json")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt"):
        load_model(tmp_path / "corrupt")
