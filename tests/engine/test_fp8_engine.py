"""The engine with an FP8 KV cache: twice (bf16) or four times (fp32) the blocks in the
same budget; the CPU attention path over an fp8 pool equals the reference; the engine's
equalities (chunked vs unchunked prefill, prefix cache warm vs cold) still hold; scales
come from calibration or from the checkpoint under the names vLLM reads; bad input is
refused with a clear error.
"""

import math

import pytest
import torch
from safetensors.torch import save_file
from test_engine import GREEDY, PROMPTS, tokens

from llmopt import LLM, SamplingParams, model_path
from llmopt.config import EngineConfig
from llmopt.fp8.format import quantize_fp8
from llmopt.fp8.kv_scales import calibration_token_ids, read_kv_scales
from llmopt.kernels.paged_attention_ref import paged_attention_ref
from llmopt.layers.attention import AttentionMetadata, attention
from llmopt.worker.kv_cache import PagedKVCache, kv_cache_torch_dtype, observe_kv_amax


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM(model="tiny", kv_cache_dtype="fp8", calculate_kv_scales=True)


# ---- memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_cache_holds_more_blocks_in_the_same_budget(dtype, ratio):
    full = LLM(model="tiny", dtype=dtype, cpu_kv_cache_space=0.01)
    fp8 = LLM(model="tiny", dtype=dtype, cpu_kv_cache_space=0.01, kv_cache_dtype="fp8")
    a, b = full.llm_engine, fp8.llm_engine
    assert a.bytes_per_block == ratio * b.bytes_per_block
    budget = 0.01 * 2**30
    assert (a.num_blocks, b.num_blocks) == (budget // a.bytes_per_block, budget // b.bytes_per_block)
    assert ratio * a.num_blocks <= b.num_blocks < ratio * (a.num_blocks + 1)
    # the pools really are that size: one byte per cached number
    assert b.kv_cache.k[0].element_size() == 1 and b.kv_cache.k[0].dtype == torch.float8_e4m3fn
    pool = lambda e: sum(t.numel() * t.element_size() for t in e.kv_cache.k + e.kv_cache.v)  # noqa: E731
    assert pool(a) <= budget and pool(b) <= budget
    assert pool(b) / b.num_blocks * ratio == pool(a) / a.num_blocks
    # and the model still runs on it
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(fp8.generate(PROMPTS[:1], short, use_tqdm=False)[0].outputs[0].token_ids) == 4


# ---- the CPU attention path over an fp8 pool -----------------------------------------------------

@pytest.mark.parametrize("fp8", ["fp8", "fp8_e5m2"])
def test_torch_path_over_fp8_pool_equals_reference(fp8):
    """Step 1 prefills three contexts; step 2 mixes a whole prompt, a chunk after cached
    context and a decode. The engine's torch path reads fp8 * scale as the reference does."""
    g = torch.Generator().manual_seed(0)
    bs, Hkv, G, D = 8, 2, 3, 16
    cache = PagedKVCache(1, 24, bs, Hkv, D, kv_cache_dtype=fp8)
    cache.set_scales([0.02], [0.005])
    perm = torch.randperm(24, generator=g).tolist()

    def step(query_lens, context_lens, tables):
        batch = AttentionMetadata.paged(tables, context_lens, query_lens, bs)
        T = sum(query_lens)
        q = torch.randn(T, Hkv * G, D, generator=g)
        k, v = torch.randn(T, Hkv, D, generator=g) * 3, torch.randn(T, Hkv, D, generator=g) * 0.5
        return batch, q, k, v

    tables = [perm[0:3], perm[3:6], perm[6:9]]
    step1 = step([13, 20, 4], [0, 0, 0], tables)
    attention(*step1[1:], step1[0], cache, 0, scale=D ** -0.5)
    batch, q, k, v = step([11, 5, 1], [0, 13, 20], [perm[9:11], tables[0], tables[1]])
    cache.use_attention("torch")  # the torch path first; the C++ kernel after the Triton one
    for window in (None, 5):
        got = attention(q, k, v, batch, cache, 0, scale=D ** -0.5, window=window)
        want = paged_attention_ref(q, cache.k[0], cache.v[0], batch.block_table_tensor,
                                   batch.query_start_loc, batch.seq_lens_tensor, D ** -0.5, window,
                                   k_scale=0.02, v_scale=0.005)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # the Triton kernels (as the cache calls them on CUDA; here under the interpreter), same answer
        cache.use_attention("triton")
        torch.testing.assert_close(attention(q, k, v, batch, cache, 0, scale=D ** -0.5, window=window), want,
                                   atol=1e-4, rtol=1e-4)
        cache.use_attention("cpu")  # the C++ kernel (where it cannot build, its wrapper runs the reference)
        torch.testing.assert_close(attention(q, k, v, batch, cache, 0, scale=D ** -0.5, window=window), want,
                                   atol=1e-4, rtol=1e-4)
        cache.use_attention("torch")
    # what the pool holds for this step's tokens is fp8(clamp(k / k_scale)), byte for byte
    stored = cache.k[0].view(-1, Hkv, D)[batch.slot_mapping]
    assert torch.equal(stored.view(torch.uint8), quantize_fp8(k, 0.02, cache.cache_dtype).view(torch.uint8))


# ---- the engine's equalities with an fp8 cache ----------------------------------------------------

@pytest.fixture(scope="module")
def fp8_plain(fp8_llm):
    """The fp8-cache engine without the optimizations: whole prompts, no prefix cache."""
    llm = LLM(model="tiny", kv_cache_dtype="fp8", calculate_kv_scales=True, enable_chunked_prefill=False,
              enable_prefix_caching=False)
    assert llm.llm_engine.kv_cache.k_scale == fp8_llm.llm_engine.kv_cache.k_scale  # calibration is deterministic
    return llm


def test_fp8_chunked_prefill_equals_unchunked(fp8_plain):
    chunked = LLM(model="tiny", kv_cache_dtype="fp8", calculate_kv_scales=True, max_num_batched_tokens=7,
                  enable_chunked_prefill=True, enable_trace=True)
    expected = tokens(fp8_plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    trace = chunked.llm_engine.trace
    assert any(0 < s["context_len"] and s["kind"] == "prefill" for t in trace for s in t["scheduled"])


def test_fp8_prefix_cache_warm_equals_cold(fp8_plain, fp8_llm):
    system = "# Utilities shared by every request in this file.\nimport math\nimport os\n\n\n"
    prompts = [system + p for p in PROMPTS]
    expected = tokens(fp8_plain.generate(prompts, GREEDY, use_tqdm=False))  # cold: no prefix cache
    hits = fp8_llm.get_metrics()["prefix_cache_hits"]
    first = tokens(fp8_llm.generate(prompts[:1], GREEDY, use_tqdm=False))
    rest = tokens(fp8_llm.generate(prompts[1:], GREEDY, use_tqdm=False))
    assert first + rest == expected
    # later requests read the system prompt's keys and values back from cached fp8 blocks
    assert fp8_llm.get_metrics()["prefix_cache_hits"] - hits >= 4 * 16


def test_fp8_greedy_mostly_agrees_with_full_precision(fp8_llm, tiny_llm):
    """Not equal (the cache rounds), but close: most greedy tokens agree before any divergence."""
    full = tokens(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    fp8 = tokens(fp8_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(full, fp8)]
    assert sum(first_diff) >= 0.5 * sum(map(len, full))


# ---- where the scales come from ----------------------------------------------------------------

def test_calibrated_scales_are_the_observed_amax_over_448(fp8_llm):
    eng = fp8_llm.llm_engine
    assert eng.kv_cache.scale_source == "calibrated"
    ids = calibration_token_ids(eng.tokenizer, seq_len=512)
    assert sum(map(len, ids)) == 4096
    k_amax, v_amax = observe_kv_amax(eng.model, ids, eng.model_config.num_hidden_layers)
    assert eng.kv_cache.k_scale == pytest.approx([a / 448 for a in k_amax], rel=1e-6)
    assert eng.kv_cache.v_scale == pytest.approx([a / 448 for a in v_amax], rel=1e-6)
    assert all(0 < a < 448 for a in k_amax + v_amax)


def test_unit_scales_without_calibration_or_checkpoint_scales():
    cache = LLM(model="tiny", kv_cache_dtype="fp8_e5m2", num_kv_blocks=64).llm_engine.kv_cache
    assert cache.scale_source == "unit" and cache.k_scale == cache.v_scale == [1.0] * 6
    assert cache.cache_dtype == torch.float8_e5m2


@pytest.fixture()
def checkpoint_with_kv_scales(tmp_path):
    """The bundled tiny model plus a second safetensors file of per-layer KV scales."""
    def make(tensors):
        folder = tmp_path / "tiny-kv-scales"
        folder.mkdir(exist_ok=True)
        for f in model_path("tiny").iterdir():
            if not (folder / f.name).exists():
                (folder / f.name).symlink_to(f)
        save_file(tensors, str(folder / "kv_scales.safetensors"))
        return folder
    return make


@pytest.mark.parametrize("naming", ["self_attn", "output_scale", "modelopt", "kv_scale"])
def test_checkpoint_scales_are_read_under_vllms_names(checkpoint_with_kv_scales, naming):
    """llm-compressor (self_attn.k_scale; older: k_proj.output_scale), ModelOpt
    (k_proj.k_scale) and the deprecated single kv_scale, as vLLM's loader maps them."""
    k = [0.01 * (i + 1) for i in range(6)]
    v = [0.002 * (i + 1) for i in range(6)]
    names = {"self_attn": ("self_attn.k_scale", "self_attn.v_scale"),
             "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
             "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
             "kv_scale": ("self_attn.kv_scale", None)}[naming]
    tensors = {}
    for i in range(6):
        tensors[f"model.layers.{i}.{names[0]}"] = torch.tensor(k[i])
        if names[1]:
            tensors[f"model.layers.{i}.{names[1]}"] = torch.tensor([v[i]])  # shape [1] as some tools write
    folder = checkpoint_with_kv_scales(tensors)
    got_k, got_v = read_kv_scales(folder, 6)
    assert got_k == pytest.approx(k)
    assert got_v == pytest.approx(k if naming == "kv_scale" else v)


def test_engine_takes_checkpoint_scales_unless_asked_to_calibrate(checkpoint_with_kv_scales, tiny_llm):
    k = [0.01 * (i + 1) for i in range(6)]
    tensors = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(k[i] / (1 if w == "k" else 4))
               for i in range(6) for w in "kv"}
    folder = str(checkpoint_with_kv_scales(tensors))
    llm = LLM(model=folder, kv_cache_dtype="fp8", num_kv_blocks=64)
    cache = llm.llm_engine.kv_cache
    assert cache.scale_source == "checkpoint"
    assert cache.k_scale == pytest.approx(k) and cache.v_scale == pytest.approx([s / 4 for s in k])
    # the scale tensors are not weights: the model loads and computes as the plain one does
    for a, b in zip(llm.model.parameters(), tiny_llm.model.parameters()):
        assert torch.equal(a, b)
    # calibration, when asked for, wins over the checkpoint (as vLLM's calculate_kv_scales does)
    calibrated = LLM(model=folder, kv_cache_dtype="fp8", calculate_kv_scales=True, num_kv_blocks=64)
    assert calibrated.llm_engine.kv_cache.scale_source == "calibrated"
    assert calibrated.llm_engine.kv_cache.k_scale != cache.k_scale


def test_bad_checkpoint_scales_are_refused(checkpoint_with_kv_scales):
    partial = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.1) for i in range(4)}
    partial.update({f"model.layers.{i}.self_attn.v_scale": torch.tensor(0.1) for i in range(6)})
    folder = checkpoint_with_kv_scales(partial)
    with pytest.raises(ValueError, match=r"no k_scale for layers \[4, 5\]"):
        read_kv_scales(folder, 6)
    folder = checkpoint_with_kv_scales({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)})
    with pytest.raises(ValueError, match="positive finite"):
        LLM(model=str(folder), kv_cache_dtype="fp8", num_kv_blocks=64)
    folder = checkpoint_with_kv_scales({"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match="one element"):
        read_kv_scales(folder, 6)
    assert read_kv_scales(model_path("tiny"), 6) is None


def test_per_head_scales_and_the_rotation_are_engine_options():
    """The best FP8 KV setting of the precision table (per-head scales over Hadamard-rotated keys and
    values) from LLM arguments: the pool calibrated so, and its text close to the plain pool's."""
    llm = LLM(model="tiny", kv_cache_dtype="fp8", calculate_kv_scales="attn_head", kv_cache_rotation="hadamard",
              num_kv_blocks=64)
    pool = llm.llm_engine.kv_cache
    assert pool.scale_source == "calibrated per head, rotated" and pool.rotation is not None
    assert all(torch.as_tensor(s).numel() == pool.k[0].shape[2] for s in pool.k_scale + pool.v_scale)
    per_layer = LLM(model="tiny", kv_cache_dtype="fp8", calculate_kv_scales="tensor", num_kv_blocks=64)
    assert per_layer.llm_engine.kv_cache.scale_source == "calibrated" and per_layer.llm_engine.kv_cache.rotation is None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os\n"]
    full = [o.outputs[0].token_ids for o in LLM(model="tiny", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(a[:4] == b[:4] for a, b in zip(got, full)) == 2  # the first tokens of each unchanged


# ---- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_cache_dtype="fp16"), "kv_cache_dtype must be one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2"),
    (dict(kv_cache_dtype="fp8_e4m3fnuz"), "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype=None), "kv_cache_dtype must be one of"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales=True calibrates the scales of an FP8 KV cache"),
    (dict(kv_cache_dtype="bfloat16", calculate_kv_scales=True), "calculate_kv_scales=True calibrates"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales="per_head"), "calculate_kv_scales must be False, True .* 'attn_head'"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=1), "calculate_kv_scales must be False, True"),
    (dict(kv_cache_dtype="fp8", kv_cache_rotation="hadamard"), "set calculate_kv_scales=True .* too"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_cache_rotation="random"),
     "kv_cache_rotation must be None or 'hadamard'"),
])
def test_bad_kv_cache_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_kv_cache_types_and_scales_are_refused():
    with pytest.raises(ValueError, match="calculate_kv_scales must be False, True"):
        EngineConfig(kv_cache_dtype="fp8", calculate_kv_scales="yes")
    with pytest.raises(ValueError, match="the model's dtype cannot be torch.float8_e4m3fn"):
        PagedKVCache(1, 4, 8, 1, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'bfloat16', 'fp8'"):
        kv_cache_torch_dtype("int2", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        kv_cache_torch_dtype(torch.float16, torch.float32)
    assert kv_cache_torch_dtype(torch.float8_e5m2, torch.bfloat16) == torch.float8_e5m2
    full = PagedKVCache(2, 4, 8, 1, 16)
    with pytest.raises(ValueError, match="apply to an FP8 KV cache"):
        full.set_scales([1.0, 1.0], [1.0, 1.0])
    fp8 = PagedKVCache(2, 4, 8, 1, 16, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="expected 2 scales"):
        fp8.set_scales([1.0], [1.0, 1.0])
    for bad in (0.0, -0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="v_scale must be positive finite"):
            fp8.set_scales([1.0, 1.0], [1.0, bad])
    with pytest.raises(ValueError, match="non-empty sequence"):
        observe_kv_amax(torch.nn.Linear(1, 1), [[]], 2)


def test_cli_flags_reach_the_engine_config():
    from llmopt.cli import build_parser
    from llmopt.engine_args import engine_kwargs

    args = build_parser().parse_args(["generate", "x", "--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales"])
    kw = engine_kwargs(args)
    assert kw["kv_cache_dtype"] == "fp8_e5m2" and kw["calculate_kv_scales"] is True
    assert EngineConfig(**{k: v for k, v in kw.items() if k != "model"}).calculate_kv_scales
    assert engine_kwargs(build_parser().parse_args(["generate", "x"]))["calculate_kv_scales"] is False
