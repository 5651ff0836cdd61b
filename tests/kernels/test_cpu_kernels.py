"""The C++ CPU kernels (llmopt.kernels.cpu) against their plain-torch meanings.

Paged attention = `paged_attention_ref` on decode and mixed batches, GQA groups 1 / 3 / 8,
blocks scattered over the pool in shuffled order and every slot no sequence owns filled with
NaN. GGUF blocks through the kernel: with float32 activations = `gguf.quants.dequantize(W)`
times x; with int8 activations (llama.cpp's arithmetic) = an exact emulation of that
arithmetic in torch (`GGUFBlockWeight.emulate_int8`, integer block sums, up to fp32 rounding
of the sum) and close to the dense product. The engine on a tiny GGUF file gives the same
greedy tokens through the kernels as through its dequantized weights, and without a C++
compiler it says so once and still gives them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from llmopt.kernels import cpu
from llmopt.kernels.cpu.gguf_blocks import GGUFBlockWeight, quantize_activations
from llmopt.kernels.cpu.paged_attention import paged_attention_cpu
from llmopt.kernels.paged_attention_ref import paged_attention_ref
from llmopt.spec.draft_tree import tree_bits, tree_mask
from llmopt.worker.kv_cache import write_kv

needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"no C++ CPU kernels: {cpu.why_unavailable()}")
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
GGUF_TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def paged_batch(seq_lens, query_lens, *, num_kv_heads=2, group=3, head_dim=64, block_size=16,
                dtype=torch.float32, seed=0):
    """Keys and values of every token written through the block table into a NaN-filled pool
    whose blocks are handed out in shuffled order (and a few never handed out)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool, v_pool = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    table = torch.full((len(seq_lens), max(per_seq) + 2), 10 ** 6, dtype=torch.int32)  # junk past the end
    used = 0
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        table[i, :nb] = order[used:used + nb].int()
        used += nb
        pos = torch.arange(n)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        write_kv(torch.randn(n, num_kv_heads, head_dim, generator=g), torch.randn(n, num_kv_heads, head_dim, generator=g),
                 k_pool, v_pool, slots)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(query_lens)).cumsum(0).int()
    return q, k_pool, v_pool, table, qsl, torch.tensor(seq_lens, dtype=torch.int32), head_dim ** -0.5


def check_attention(batch, window=None, tree_bits=None):
    q, k_pool, v_pool, table, qsl, lens, scale = batch
    got = paged_attention_cpu(q, k_pool, v_pool, table, qsl, lens, scale, window, tree_bits=tree_bits)
    want = paged_attention_ref(q, k_pool, v_pool, table.clamp(max=k_pool.shape[0] - 1), qsl, lens, scale, window,
                               tree_bits=tree_bits)
    assert got.dtype == q.dtype and got.shape == q.shape and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])


# ---- paged attention ---------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_batch_equals_reference(group, dtype, window):
    lens = [1, 15, 16, 17, 100, 300]
    check_attention(paged_batch(lens, [1] * len(lens), group=group, dtype=dtype, seed=group), window)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 20])
def test_mixed_batch_equals_reference(group, dtype, window):
    # a whole prompt, a chunk after cached context (more than one query tile), decodes
    lens, new = [40, 90, 7, 257], [40, 35, 1, 1]
    check_attention(paged_batch(lens, new, group=group, dtype=dtype, block_size=8, seed=10 + group), window)


@needs_kernels
@pytest.mark.parametrize("block_size, group, head_dim", [(16, 3, 64), (32, 2, 128), (8, 4, 32)])
@pytest.mark.parametrize("window", [None, 37])
def test_float32_queries_over_bfloat16_pools_equal_reference(block_size, group, head_dim, window):
    # kv_cache_dtype="bfloat16": rows widened exactly, so float32's tolerance; block ends, a slice's
    # partial 16 keys, and one sequence cut into slices (prefetches past a slice's end stay in bounds)
    for lens in ([1, 15, 16, 17, 33, 190, 700], [600]):
        q, k, v, table, qsl, seq_lens, scale = paged_batch(lens, [1] * len(lens), num_kv_heads=3 - 2 * (len(lens) == 1),
                                                           group=group, head_dim=head_dim, block_size=block_size, seed=5)
        check_attention((q, k.bfloat16(), v.bfloat16(), table, qsl, seq_lens, scale), window)


@needs_kernels
@pytest.mark.parametrize("window", [None, 700])
def test_one_long_context_sliced_across_threads_equals_reference(window):
    # one sequence and one kv head: too few work items, so the keys are sliced and merged
    check_attention(paged_batch([2000], [1], num_kv_heads=1, group=8, seed=3), window)
    check_attention(paged_batch([3000, 5], [3, 1], num_kv_heads=1, group=1, seed=4), window)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, group, head_dim", [(16, 3, 64), (32, 8, 32), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 45])
def test_long_prompts_equal_reference(block_size, group, head_dim, dtype, window):
    # a 300-token prompt and a 250-token chunk after 57 cached tokens: many query tiles, 8 to 128
    # rows an item, tiles across block edges; then 20 queries after 600 keys, sliced across threads
    check_attention(paged_batch([300, 307], [300, 250], group=group, head_dim=head_dim, block_size=block_size,
                                dtype=dtype, seed=50 + group), window)
    check_attention(paged_batch([620], [20], num_kv_heads=1, group=group, head_dim=head_dim, block_size=block_size,
                                dtype=dtype, seed=60 + group), window)


def random_tree_bits(n: int, g: torch.Generator) -> list[int]:
    """A random draft tree of n - 1 nodes (parents before children) as per-row masks."""
    return tree_bits([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n - 1)])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_draft_tree_masks_equal_reference(dtype, group):
    """Verification of draft trees (a root and its nodes per sequence, each node seeing the
    context and its ancestors) beside a causal chunk and a decode in the same call; one tree
    long enough (>= 256 keys, one kv head) that its keys are sliced across threads."""
    g = torch.Generator().manual_seed(group)
    new = [17, 9, 1, 30]
    bits = random_tree_bits(17, g) + [-1] * 9 + [-1] + random_tree_bits(30, g)
    batch = paged_batch([60, 33, 20, 300], new, group=group, dtype=dtype, block_size=8, seed=20 + group)
    check_attention(batch, tree_bits=torch.tensor(bits))
    long = paged_batch([700], [10], num_kv_heads=1, group=group, dtype=dtype, seed=30 + group)
    check_attention(long, tree_bits=torch.tensor(random_tree_bits(10, g)))
    widest = paged_batch([90], [64], group=group, dtype=dtype, seed=40 + group)  # 63 nodes: every bit
    check_attention(widest, tree_bits=torch.tensor(random_tree_bits(64, g)))


def test_tree_bits_reference_is_the_ancestor_mask():
    """The reference's reading of tree_bits equals attention under the boolean tree mask."""
    parents = [-1, -1, 0, 1, 1, 3, 2]
    q, k_pool, v_pool, table, qsl, lens, scale = paged_batch([25], [8], group=2, seed=1)
    got = paged_attention_ref(q, k_pool, v_pool, table.clamp(max=k_pool.shape[0] - 1), qsl, lens, scale,
                              tree_bits=torch.tensor(tree_bits(parents)))
    mask = tree_mask(17, parents)                                  # [8, 25]
    blocks = table[0, :2].long()
    k = k_pool[blocks].flatten(0, 1)[:25].repeat_interleave(2, 1)
    v = v_pool[blocks].flatten(0, 1)[:25].repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(got, want)


@needs_kernels
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_equals_reference(fp8):
    q, k_pool, v_pool, table, qsl, lens, scale = paged_batch([33, 70], [1, 5], seed=5)
    k8 = (k_pool / 0.5).to(fp8)
    v8 = (v_pool / 0.25).to(fp8)
    got = paged_attention_cpu(q, k8, v8, table, qsl, lens, scale, k_scale=0.5, v_scale=0.25)
    want = paged_attention_ref(q, k8, v8, table.clamp(max=k8.shape[0] - 1), qsl, lens, scale,
                               k_scale=0.5, v_scale=0.25)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_kernels
def test_bad_attention_inputs_are_refused():
    q, k_pool, v_pool, table, qsl, lens, scale = paged_batch([20], [1])
    with pytest.raises(ValueError, match="block_table entry"):
        paged_attention_cpu(q, k_pool, v_pool, torch.full_like(table, 99), qsl, lens, scale)
    with pytest.raises(ValueError, match="queries but seq_len"):
        paged_attention_cpu(torch.cat([q] * 30), k_pool, v_pool, table, torch.tensor([0, 30], dtype=torch.int32),
                            lens, scale)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_cpu(q, k_pool, v_pool, table.long(), qsl, lens, scale)
    with pytest.raises(TypeError, match="q must be"):
        paged_attention_cpu(q.half(), k_pool, v_pool, table, qsl, lens, scale)
    with pytest.raises(ValueError, match="window"):
        paged_attention_cpu(q, k_pool, v_pool, table, qsl, lens, scale, window=0)


# ---- GGUF blocks -------------------------------------------------------------------------------

def gguf_weight(kind, rows=96, cols=576, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, :64] += 0.4    # lopsided blocks: Q4_1's min and the scales differ by block
    w[1, 32:64] = 0     # an all-zero block
    data = quantize(w, T[kind])
    return GGUFBlockWeight.from_gguf_bytes(data, kind, cols), torch.from_numpy(dequantize(data, T[kind]))


def activations(rows, cols=576, seed=1):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 2
    x[0, :32] = 0       # an all-zero block of x: scale 0
    return x


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_blocks_mean_what_the_gguf_package_reads(kind):
    w, ref = gguf_weight(kind)
    assert torch.equal(w.dequantize(), ref)
    assert w.nbytes() == w.out_features * w.in_features // 32 * {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]


@needs_kernels
@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 33])
def test_float32_activations_equal_dequantized_weight_times_x(kind, rows):
    w, ref = gguf_weight(kind)
    x = activations(rows)
    torch.testing.assert_close(w.matmul(x, "float32"), x @ ref.T, atol=1e-5, rtol=1e-5)
    xb = x.bfloat16()
    got = w.matmul(xb, "float32")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (xb.float() @ ref.T).bfloat16().float(), atol=1e-2, rtol=1e-2)


@needs_kernels
def test_activation_rounding_is_llama_cpps():
    x = activations(5)
    x[2, 40] = 0.5 * x[2, 32:64].abs().max() / 127 * 3  # an exact half step: rounds to even
    mine, kernel = quantize_activations(x), cpu.load().quantize_activations(x)
    for a, b in zip(mine, kernel):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_equal_their_emulation_and_approach_the_dense_product(kind, rows, dtype):
    w, ref = gguf_weight(kind, seed=rows)
    x = activations(rows, seed=rows).to(dtype)
    got = w.matmul(x).double()
    emulated = w.emulate_int8(x)
    # the integer parts are exact; only the fp32 sum over a row's blocks is ordered differently
    bound = 1e-6 * emulated.abs().max() if dtype == torch.float32 else 4e-3 * emulated.abs().max()
    assert (got - emulated).abs().max() <= bound
    dense = x.float() @ ref.T
    assert ((got.float() - dense).norm() / dense.norm()) < 0.01   # x rounded to ~7 bits per value


@needs_kernels
@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("cols", [64, 96, 448, 544])
def test_int8_activations_with_every_count_of_blocks_per_row(kind, rows, cols):
    """AVX512_VNNI and the AVX2 rows take blocks two at a time (gguf_vnni.h, gguf_rows_avx2.h), the
    AVX2 rows their scales eight blocks at a time: 2 blocks (one pair, no group of eight), 14 (one
    group and three pairs) take those; a row of 3 or 17 blocks takes the one-block loop instead,
    with the same arithmetic."""
    w, _ = gguf_weight(kind, rows=70, cols=cols, seed=cols)
    x = activations(rows, cols=cols, seed=rows)
    emulated = w.emulate_int8(x)
    assert (w.matmul(x).double() - emulated).abs().max() <= 1e-6 * emulated.abs().max()


@needs_kernels
@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 130])
def test_panels_equal_the_row_layout(kind, rows):
    """Where the CPU has AVX512_VNNI the blocks run repacked in panels of 16 rows (gguf_panels.h):
    the same integers as the row layout, tiles of 4 rows of x and 2 panels with every remainder
    (7 panels; 1, 3 or 9 rows), and a prompt's many rows."""
    w, _ = gguf_weight(kind, rows=112, cols=544, seed=rows)
    panels = w.panels()
    if panels is None:
        pytest.skip("no AVX512_VNNI in this build: the row layout is the only one")
    qs, d, m = panels
    assert qs.shape == (7, 17, 16, w.qs.shape[2]) and d.shape == (7, 17, 16)
    assert torch.equal(d[2, 5], w.d[32:48, 5]) and (m.numel() == 0) == (kind != "Q4_1")
    x = activations(rows, cols=544, seed=rows)
    ext = cpu.load()
    by_rows = ext.gguf_matmul(x, w.qs, w.d, w._no_min if w.m is None else w.m, w.ggml_type, True).double()
    by_panels = ext.gguf_matmul(x, qs, d, m, w.ggml_type, True).double()
    emulated = w.emulate_int8(x)
    assert (by_panels - emulated).abs().max() <= 1e-6 * emulated.abs().max()
    assert (by_panels - by_rows).abs().max() <= 1e-6 * emulated.abs().max()
    with pytest.raises(ValueError, match="int8 activations only"):
        ext.gguf_matmul(x, qs, d, m, w.ggml_type, False)
    with pytest.raises(ValueError, match="panel d"):
        ext.gguf_matmul(x, qs, d[:, :16].contiguous(), m, w.ggml_type, True)
    assert GGUFBlockWeight("Q8_0", w.qs[:40].contiguous() if kind == "Q8_0" else torch.zeros(40, 17, 32, dtype=torch.uint8),
                           torch.ones(40, 17).half()).panels() is None    # 40 rows: not whole panels


@needs_kernels
def test_bad_matmul_inputs_are_refused():
    w, _ = gguf_weight("Q8_0")
    with pytest.raises(ValueError, match="x has K"):
        w.matmul(torch.randn(1, 64))
    with pytest.raises(ValueError, match="x must be"):
        w.matmul(torch.randn(1, 576).half())
    with pytest.raises(ValueError, match="activations"):
        w.matmul(torch.randn(1, 576), "int4")
    with pytest.raises(ValueError, match="multiple"):
        GGUFBlockWeight.from_gguf_bytes(np.zeros((2, 34), np.uint8), "Q8_0", 33)


# ---- the engine on a GGUF file -----------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    from llmopt.quant.gguf_write import write_gguf

    folder = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf("tiny", q, folder / f"tiny-{q}.gguf").path for q in GGUF_TYPES}


PROMPTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3,"]


def greedy_tokens(path, **kw):
    from llmopt import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, **kw)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in out]


@needs_kernels
@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_engine_through_the_block_kernels_equals_dequantized_weights(gguf_files, kind):
    from llmopt.layers.quant.gguf_linear import GGUFLinear

    _, dense = greedy_tokens(gguf_files[kind])
    llm, kept = greedy_tokens(gguf_files[kind], quantization="gguf")
    blocks = [m for m in llm.llm_engine.model.modules() if isinstance(m, GGUFLinear)]
    assert len(blocks) == 6 * 4 + 1 and all(m.weight_blocks.type_name == kind for m in blocks)
    for m in blocks:      # the same kernel, llama.cpp's arithmetic switched off: x unrounded
        m.activations = "float32"
    _, exact = greedy_tokens_of(llm)
    assert exact == dense
    assert kept == dense


def greedy_tokens_of(llm):
    from llmopt import SamplingParams

    out = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in out]


def test_without_a_compiler_a_notice_and_the_same_tokens(gguf_files, tmp_path):
    _, dense = greedy_tokens(gguf_files["Q8_0"])
    code = ("import json, sys\n"
            "from llmopt import LLM, SamplingParams\n"
            f"llm = LLM({str(gguf_files['Q8_0'])!r}, dtype='float32', num_kv_blocks=64, quantization='gguf')\n"
            f"out = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), "
            "use_tqdm=False)\n"
            "from llmopt.kernels import cpu\n"
            "print(json.dumps([cpu.available(), [o.outputs[0].token_ids for o in out]]))\n")
    env = dict(os.environ, CXX="/bin/false", LLMOPT_CACHE=str(tmp_path / "empty-cache"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    import json

    available, tokens = json.loads(run.stdout.strip().splitlines()[-1])
    notices = [line for line in run.stderr.splitlines() if "C++ CPU kernels could not be built" in line]
    assert available is False and len(notices) == 1
    assert tokens == dense
