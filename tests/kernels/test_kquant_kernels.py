"""GGUF k-quant super-blocks (Q4_K, Q6_K) kept as stored and multiplied by the C++ kernels.

The bytes: from llmopt's quantizers (llmopt.quant.kquants) and random bytes with sane fp16
scales (every 6-bit scale and minimum, every int8 scale down to -128). `KQuantWeight.dequantize`
must be `gguf.quants.dequantize` bit for bit. Through the kernel (kquant_matmul.cpp): with
float32 activations = that weight times x, up to the order of float32 sums; with int8
activations (llama.cpp's Q8_K arithmetic) = `emulate_int8`, its exact integer sums in torch, up
to the order of the float32 sums, and close to the dense product. Rows of x 1 to 17 (tiles of 4
and their remainders), K of 1, 2 and 9 super-blocks, N not a multiple of 4 or 16. A stack of
both types and reordered rows run as their parts do. A small Llama written as a Q4_K_M file
loads onto GGUFLinear layers whose weights are the dense load's, gives its logits and greedy
tokens, and the compiled decode step gives the eager step's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from llmopt.kernels import cpu
from llmopt.kernels.cpu.kquant_blocks import MIXED, KQuantWeight, quantize_activations_k
from llmopt.quant import kquants

needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"no C++ CPU kernels: {cpu.why_unavailable()}")
KINDS = ["Q4_K", "Q6_K"]
BYTES = {"Q4_K": 144, "Q6_K": 210}


def kquant_weight(kind, rows=37, cols=512, seed=0, source="quantized"):
    """(KQuantWeight, gguf.quants' dequantization of the same bytes [rows, cols])."""
    rng = np.random.default_rng(seed)
    if source == "quantized":
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w[0, :256] += 0.3      # a lopsided super-block: minima and scales differ by sub-block
        w[1, :256] = 0         # an all-zero super-block
        data = (kquants.quantize_q4_k if kind == "Q4_K" else kquants.quantize_q6_k)(w)
    else:                      # any byte, except that the fp16 scales are small finite numbers
        data = rng.integers(0, 256, (rows, cols // 256, BYTES[kind]), dtype=np.uint8)
        for at in ((0, 2) if kind == "Q4_K" else (208,)):
            d = (rng.uniform(-1, 1, data.shape[:2]) * 2e-3).astype(np.float16)
            data[..., at:at + 2] = d.view(np.uint8).reshape(*data.shape[:2], 2)
        data = data.reshape(rows, -1)
    ref = dequantize(data, T[kind]).reshape(rows, cols)
    return KQuantWeight.from_gguf_bytes(data, kind, cols), torch.from_numpy(ref)


def activations(rows, cols=512, seed=1):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 2
    x[0, :256 if cols > 256 else 64] = 0  # an all-zero super-block of x (scale 0), where it leaves some x
    if cols >= 512:
        top = x[-1, 256:512].abs().max() + 1
        x[-1, 300] = -top                # the largest magnitude negative (d > 0) ...
        x[-1, 301] = top                 # ... and tied by a positive one after it: the first wins
    return x


def abs_product(x, ref):
    """|x| @ |W|^T: the size of the terms each output sums, which bounds its rounding."""
    return x.abs().double() @ ref.abs().double().T


# ---- the bytes' meaning --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["quantized", "random bytes"])
def test_super_blocks_mean_what_the_gguf_package_reads(kind, source):
    w, ref = kquant_weight(kind, cols=768, source=source)
    assert torch.equal(w.dequantize(), ref)
    assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert (w.type_name, w.ggml_type, w.parts) == (kind, {"Q4_K": 12, "Q6_K": 14}[kind], ((kind, 37),))
    assert w.nbytes() == 37 * 3 * BYTES[kind] and w.qs.shape == (37, 3, BYTES[kind])
    q = w.integers()
    assert q.shape == (37, 768) and q.min() >= 0 and q.max() <= (15 if kind == "Q4_K" else 63)


def q8_k_reference(row: np.ndarray):
    """llama.cpp's quantize_row_q8_K_ref, one value at a time, for one row."""
    q, d, bsums = np.zeros(row.size, np.int8), [], []
    for s in range(0, row.size, 256):
        amax = mx = np.float32(0)
        for v in row[s:s + 256]:
            if abs(v) > amax:
                amax, mx = abs(v), v
        if amax == 0:
            d.append(np.float32(0))
        else:
            iscale = np.float32(-127) / mx
            q[s:s + 256] = np.minimum(127, np.rint(iscale * row[s:s + 256]))
            d.append(np.float32(1) / iscale)
        bsums += [int(q[s + j:s + j + 16].sum()) for j in range(0, 256, 16)]
    return q, np.array(d, np.float32), np.array(bsums)


@needs_kernels
def test_activation_rounding_is_llama_cpps_q8_k():
    x = activations(3, cols=768)
    x[1, 10] = 0.5 * x[1, :256].abs().max() / 127 * 5     # a half step exactly: rounds to even
    mine, kernel = quantize_activations_k(x), cpu.load().quantize_activations_k(x)
    for a, b in zip(mine, kernel):
        assert torch.equal(a, b)
    for m in range(3):
        q, d, bsums = q8_k_reference(x[m].numpy())
        assert np.array_equal(mine[0][m].numpy(), q) and np.array_equal(mine[1][m].numpy(), d)
        assert np.array_equal(mine[2][m].numpy(), bsums)
    assert mine[1][0, 0] == 0 and mine[1][2, 1] > 0      # the zero block; a negative maximum, d > 0


# ---- the kernels -------------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["quantized", "random bytes"])
@pytest.mark.parametrize("cols", [256, 512, 2304])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
def test_float32_activations_equal_dequantized_weight_times_x(kind, source, cols, rows):
    w, ref = kquant_weight(kind, cols=cols, seed=cols, source=source)
    x = activations(rows, cols=cols, seed=rows)
    got = w.matmul(x, "float32")
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert ((got.double() - x.double() @ ref.double().T).abs() <= 5e-7 * abs_product(x, ref)).all()
    xb = x.bfloat16()
    got = w.matmul(xb, "float32")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (xb.float() @ ref.T).bfloat16().float(), atol=1e-2, rtol=1e-2)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["quantized", "random bytes"])
@pytest.mark.parametrize("cols", [256, 512, 2304])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_equal_their_emulation_and_approach_the_dense_product(kind, source, cols, rows, dtype):
    w, ref = kquant_weight(kind, cols=cols, seed=cols, source=source)
    x = activations(rows, cols=cols, seed=rows).to(dtype)
    got = w.matmul(x)
    assert got.dtype == dtype
    emulated = w.emulate_int8(x)
    # the integer parts are exact; only the float32 scaling and sum over a row's super-blocks
    # (and, for bfloat16 x, the result's rounding to bfloat16) differ
    size = abs_product(x.float(), ref)
    rounding = 5e-7 * size + (2 ** -8 * emulated.abs() if dtype == torch.bfloat16 else 0)
    assert ((got.double() - emulated).abs() <= rounding).all()
    dense = x.float() @ ref.T
    assert ((got.float() - dense).norm() / dense.norm()) < 0.03   # x rounded per 256 values to 8 bits


@needs_kernels
def test_a_stack_of_both_types_runs_as_its_parts():
    """q and k (Q4_K) with v (Q6_K), as a Q4_K_M file mixes them: one weight, one kernel call,
    each row range by its own kernel; reordered rows (llama.cpp's Q / K order undone) too."""
    q, q_ref = kquant_weight("Q4_K", rows=20, cols=512, seed=1)
    k, k_ref = kquant_weight("Q4_K", rows=7, cols=512, seed=2, source="random bytes")
    v, v_ref = kquant_weight("Q6_K", rows=9, cols=512, seed=3)
    qkv = KQuantWeight.cat([q, k, v])
    assert qkv.parts == (("Q4_K", 27), ("Q6_K", 9)) and qkv.type_name == "Q4_K+Q6_K" and qkv.ggml_type == MIXED
    assert qkv.nbytes() == q.nbytes() + k.nbytes() + v.nbytes()
    ref = torch.cat([q_ref, k_ref, v_ref])
    assert torch.equal(qkv.dequantize(), ref)
    x = activations(5, seed=4)
    for act in ("int8", "float32"):
        assert torch.equal(qkv.matmul(x, act), torch.cat([p.matmul(x, act) for p in (q, k, v)], dim=1))
    perm = torch.randperm(36, generator=torch.Generator().manual_seed(0))
    moved = qkv.rows(perm)
    assert sum(rows for _, rows in moved.parts) == 36 and len(moved.parts) > 2   # ranges split by the shuffle
    assert torch.equal(moved.dequantize(), ref[perm]) and torch.equal(moved.integers(), qkv.integers()[perm])
    for act in ("int8", "float32"):
        assert torch.equal(moved.matmul(x, act), qkv.matmul(x, act)[:, perm])
    assert torch.equal(moved.emulate_int8(x), qkv.emulate_int8(x)[:, perm])
    assert torch.equal(KQuantWeight.cat([q, k]).qs, torch.cat([q.qs, k.qs]))     # one type: one range
    assert KQuantWeight.cat([v.rows(torch.arange(9).flip(0))]).parts == (("Q6_K", 9),)
    with pytest.raises(ValueError, match="one width"):
        KQuantWeight.cat([q, kquant_weight("Q4_K", rows=3, cols=256)[0]])


@needs_kernels
def test_gguf_matmul_takes_k_quants_by_their_type():
    ext = cpu.load()
    empty = torch.empty(0, dtype=torch.float16)
    x = activations(3)
    for kind, number in (("Q4_K", 12), ("Q6_K", 14)):
        w, _ = kquant_weight(kind)
        qs, d, m = w.kernel_blocks()
        assert d.numel() == 0 and m.numel() == 0 and qs is w.qs
        assert torch.equal(ext.gguf_matmul(x, qs, d, m, number, True), w.matmul(x))
        assert torch.equal(ext.gguf_matmul(x, qs, d, m, number, False), w.matmul(x, "float32"))
        with pytest.raises(ValueError, match="d and m must be empty"):
            ext.gguf_matmul(x, qs, torch.ones(37, 2).half(), empty, number, True)


@needs_kernels
def test_bad_inputs_are_refused():
    ext = cpu.load()
    w, _ = kquant_weight("Q4_K")
    with pytest.raises(ValueError, match="parts' super-blocks take"):
        w.matmul(torch.randn(1, 256))
    with pytest.raises(ValueError, match="whole super-blocks"):
        w.matmul(torch.randn(1, 320))
    with pytest.raises(ValueError, match="x must be"):
        w.matmul(torch.randn(1, 512).half())
    with pytest.raises(ValueError, match="activations"):
        w.matmul(torch.randn(1, 512), "int4")
    with pytest.raises(ValueError, match="Q4_K \\(12\\) or Q6_K \\(14\\)"):
        ext.kquant_matmul(torch.randn(1, 512), w.qs, [13], [37], True)
    with pytest.raises(ValueError, match="multiple"):
        KQuantWeight.from_gguf_bytes(np.zeros((2, 180), np.uint8), "Q4_K", 320)
    with pytest.raises(ValueError, match="must be uint8"):
        KQuantWeight("Q6_K", w.qs)


@needs_kernels
def test_gguf_linear_runs_prompts_on_the_dense_copy():
    from llmopt.layers.quant.gguf_linear import GGUFLinear

    w, ref = kquant_weight("Q6_K")
    layer = GGUFLinear(w, bias=torch.randn(37))
    limit = layer.kernel_max_rows(torch.float32)
    assert limit == 32                                    # the row kernels' limit, on every CPU
    small, big = activations(limit), activations(limit + 1)
    assert layer.runs_kernel(small) and not layer.runs_kernel(big)
    torch.testing.assert_close(layer(big), big @ ref.T + layer.bias, atol=1e-4, rtol=1e-5)
    assert "Q6_K" in repr(layer) and layer.weight_bytes() == w.nbytes()


# ---- a model written as Q4_K_M -----------------------------------------------------------------

@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    """A random-weight Llama whose rows are whole super-blocks (hidden 256, intermediate 512,
    4 layers: llama.cpp's Q4_K_M mix gives layers 2 and 3 a Q6_K attn_v and ffn_down), untied
    (its output head Q6_K), written as a Q4_K_M GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from checkpoints import copy_tokenizer
    from llmopt.quant.gguf_write import write_gguf

    folder = tmp_path_factory.mktemp("kquant-llama")
    cfg = AutoConfig.for_model("llama", vocab_size=4096, hidden_size=256, intermediate_size=512,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, initializer_range=0.05, tie_word_embeddings=False,
                               bos_token_id=1, eos_token_id=0, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder / "hf")
    copy_tokenizer(folder / "hf")
    return write_gguf(str(folder / "hf"), "Q4_K_M", folder / "model-Q4_K_M.gguf").path


def file_types(path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


@needs_kernels
def test_a_q4_k_m_file_runs_on_its_super_blocks(q4_k_m_file):
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.layers.quant.gguf_linear import GGUFLinear
    from llmopt.model.forward import run_model
    from llmopt.model.loader import load_model
    from llmopt.worker.kv_cache import NoKVCache

    types = file_types(q4_k_m_file)
    assert {types[f"blk.{i}.attn_v.weight"] for i in range(4)} == {"Q4_K", "Q6_K"}
    dense = load_model(q4_k_m_file, torch.float32)
    kept = load_model(q4_k_m_file, torch.float32, quantization="gguf")
    blocks = {n: m for n, m in kept.named_modules() if isinstance(m, GGUFLinear)}
    assert len(blocks) == 4 * 4 + 1
    parts = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
             "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
    for i in range(4):
        for name, tensors in parts.items():
            want = "+".join(dict.fromkeys(types[f"blk.{i}.{t}.weight"] for t in tensors))
            assert blocks[f"model.layers.{i}.{name}"].weight_blocks.type_name == want
    assert blocks["model.layers.3.self_attn.qkv_proj"].weight_blocks.type_name == "Q4_K+Q6_K"
    assert blocks["lm_head"].weight_blocks.type_name == types["output.weight"] == "Q6_K"
    for name, m in blocks.items():   # the file's bytes, nothing requantized: exactly the dense load
        assert torch.equal(m.dequantize(torch.float32), dense.get_submodule(name).weight), name

    ids = torch.randint(3, 4096, (6,), generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def logits(model):   # a 6-token prompt: 6 rows of x, within the kernels' limit
        return model.compute_logits(run_model(model, NoKVCache(), ids, AttentionMetadata.uncached([len(ids)])))

    want = logits(dense)
    got = logits(kept)
    assert ((got - want).norm() / want.norm()) < 0.05                       # x rounded to 8 bits per 256
    for m in blocks.values():
        m.activations = "float32"
    torch.testing.assert_close(logits(kept), want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)


@needs_kernels
def test_a_q4_k_m_file_greedy_and_compiled_equal_eager(q4_k_m_file):
    from llmopt import LLM, SamplingParams

    prompts = ["def fibonacci(n):", "The capital of France is"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    settings = dict(model=str(q4_k_m_file), dtype="float32", num_kv_blocks=64, seed=0)
    dense = tokens(LLM(**settings, enforce_eager=True))
    compiled = LLM(**settings, quantization="gguf")
    eager = LLM(**settings, quantization="gguf", enforce_eager=True)
    assert compiled.llm_engine.decode_path == "compiled"
    # the same attention kernel on both sides, so that only the step differs (see
    # tests/worker/test_compiled_decode.py's SmolLM2 GGUF test for why)
    eager.llm_engine.kv_cache.use_attention("cpu")
    assert tokens(compiled) == tokens(eager)
    for m in eager.llm_engine.model.modules():     # x unrounded: the dequantized model's tokens
        if hasattr(m, "weight_blocks"):
            m.activations = "float32"
    assert tokens(eager) == dense
