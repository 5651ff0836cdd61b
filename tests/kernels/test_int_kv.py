"""The int8 / int4 KV pool (llmopt/kernels/int_kv_ref.py): its format, its write, its read.

- int8's scales are the smallest powers of two that hold each group's amax; int4's groups span
  their numbers; int4 codes pack and unpack; a block written a token at a time, in chunks or whole
  ends with the group of all its tokens and stays close to what was written.
- The C++ write (int_kv.h) stores the same bytes as the torch write, token by token and in
  chunks, bf16 and fp32; the C++ attention over an int pool equals the torch reference.
- The engine: the compiled step (C++ write and read) gives the eager path's greedy tokens; the pool
  prices its scales in; bad input is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.kernels import cpu
from llmopt.kernels.cpu.paged_attention import paged_attention_cpu
from llmopt.kernels.int_kv_ref import (INT_KV_DTYPES, bytes_per_token, dequantize4, group_of, pack, quantize4,
                                       read_keys, read_values, scale_bytes, scale_shapes, scale_value, unpack,
                                       write_int_kv)
from llmopt.kernels.paged_attention_ref import paged_attention_ref
from llmopt.worker.kv_cache import PagedKVCache

needs_kernels = pytest.mark.skipif(not cpu.available(), reason=f"no C++ CPU kernels: {cpu.why_unavailable()}")
BITS = {"int8": 8, "int4": 4}


def empty_pool(kind, blocks=6, bs=16, heads=3, d=64):
    bits = BITS[kind]
    shape = (blocks, bs, heads, d * bits // 8)
    fill = torch.full(shape, 0x5A, dtype=torch.uint8)   # junk where nothing was written
    (ks, kd), (vs, vd) = scale_shapes(blocks, bs, heads, d, bits)
    return (fill.view(INT_KV_DTYPES[kind]).clone(), fill.view(INT_KV_DTYPES[kind]).clone(),
            torch.zeros(ks, dtype=kd), torch.zeros(vs, dtype=vd))


def keys_values(n, heads=3, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, d, generator=g) * torch.linspace(0.05, 6.0, d)  # channels of very different size
    k[:, :, 7] += 9.0   # an outlier channel, as keys have
    v = torch.randn(n, heads, d, generator=g)
    v[2] = 0.0          # an all-zero token: scale 2^-126, codes 0
    return k.to(dtype), v.to(dtype)


def test_int8_scales_are_the_smallest_powers_of_two_that_hold_the_amax():
    amax = torch.tensor([0.0, 1e-40, 0.3, 1.0, 7.0, 127.0, 1000.0, 3.0e38])
    s = scale_value(scale_bytes(amax))
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))
    held = amax > 1e-30
    assert torch.all(amax[held] / s[held] <= 127) and torch.all(amax[held] / (s[held] / 2) > 127)
    assert scale_bytes(torch.tensor([0.0])).item() == 1


def test_int4_groups_span_their_numbers_and_codes_pack_two_a_byte():
    x = torch.tensor([[-3.0, 0.5, 2.0, 9.0], [4.0, 4.0, 4.0, 4.0]])
    g = group_of(x.amin(-1), x.amax(-1))
    assert g.dtype == torch.float16 and torch.equal(g[0], torch.tensor([0.8, -3.0]).half())
    q = quantize4(x, g[:, None])
    assert q[0].tolist() == [0, 4, 6, 15] and q[1].tolist() == [0, 0, 0, 0]   # a flat group: codes 0, read back m
    assert torch.allclose(dequantize4(q, g[:, None]), x, atol=0.41)
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)[:28].view(2, 14)
    packed = pack(codes, 4)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 7)
    assert torch.equal(unpack(packed, 4), codes)
    assert int(packed[0, 0]) == 0 | (7 << 4)   # channel 0 in the low nibble, channel 7 (= 14 / 2) in the high


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("split", [[20], [1] * 20, [5, 1, 1, 13], [16, 4]])
def test_a_block_written_in_pieces_holds_its_keys_and_values(kind, split):
    bits = BITS[kind]
    k, v = keys_values(20)
    kp, vp, ks, vs = empty_pool(kind)
    slots = torch.cat([torch.arange(16) + 3 * 16, torch.arange(4) + 1 * 16])   # block 3 full, block 1 begun
    start = 0
    for n in split:
        write_int_kv(k[start:start + n], v[start:start + n], kp, vp, ks, vs, slots[start:start + n], bits)
        start += n
    keys = read_keys(kp, ks, torch.tensor([3, 1]), bits).flatten(0, 1)[:20]
    values = read_values(vp, vs, torch.tensor([3, 1]), bits).flatten(0, 1)[:20]
    # a block's key group per channel is its tokens' (int4: at least as wide, if it grew in steps)
    for b, part in ((3, k[:16]), (1, k[16:])):
        if bits == 8:
            assert torch.equal(ks[b], scale_bytes(part.abs().amax(0)))
        else:
            lo, hi = ks[b][..., 1].float(), ks[b][..., 0].float() * 15 + ks[b][..., 1].float()
            assert torch.all(lo <= part.amin(0) + 1e-2 * part.abs().amax(0)) and torch.all(hi >= part.amax(0) - 1e-2 * part.abs().amax(0))
            if len(split) == 1 or split == [16, 4]:   # written whole: exactly its tokens' group
                assert torch.equal(ks[b], group_of(part.amin(0), part.amax(0)))
    tol = {8: 0.02, 4: 0.12}[bits]   # relative error of the whole tensor
    assert (keys - k).norm() / k.norm() < tol and (values - v).norm() / v.norm() < tol
    assert torch.all(values[2] == 0)


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_write_stores_the_torch_writes_bytes(kind, dtype):
    bits = BITS[kind]
    k, v = keys_values(40, dtype=dtype, seed=1)
    slots = torch.cat([torch.arange(16) + 2 * 16, torch.arange(16) + 5 * 16, torch.arange(8) + 0 * 16])
    want, got = empty_pool(kind), empty_pool(kind)
    for a, b in ((0, 3), (3, 4), (4, 10), (10, 21), (21, 22), (22, 40)):   # decode-like and chunk-like steps
        write_int_kv(k[a:b], v[a:b], *want, slots[a:b], bits)
        cpu.load().write_int_kv(k[a:b].contiguous(), v[a:b].contiguous(), slots[a:b].contiguous(), *got)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def int_batch(kind, seq_lens, query_lens, dtype=torch.float32, seed=0, bs=16, heads=2, group=3, d=64):
    bits = BITS[kind]
    blocks = sum(-(-n // bs) for n in seq_lens) + 2
    kp, vp, ks, vs = empty_pool(kind, blocks=blocks, bs=bs, heads=heads, d=d)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(seq_lens), max(-(-n // bs) for n in seq_lens), dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // bs)
        table[i, :nb] = order[used:used + nb].int()
        used += nb
        pos = torch.arange(n)
        slots = table[i, pos // bs].long() * bs + pos % bs
        k, v = keys_values(n, heads, d, seed=seed + i)
        write_int_kv(k, v, kp, vp, ks, vs, slots, bits)
    q = torch.randn(sum(query_lens), heads * group, d, generator=torch.Generator().manual_seed(seed + 99)).to(dtype)
    qsl = torch.tensor([0] + list(query_lens)).cumsum(0).int()
    return q, kp, vp, table, qsl, torch.tensor(seq_lens, dtype=torch.int32), d ** -0.5, ks, vs


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_attention_over_an_int_pool_equals_the_reference(kind, dtype):
    q, kp, vp, table, qsl, lens, scale, ks, vs = int_batch(kind, [37, 300, 5, 64], [1, 1, 5, 20], dtype)
    got = paged_attention_cpu(q, kp, vp, table, qsl, lens, scale, k_scales=ks, v_scales=vs)
    want = paged_attention_ref(q, kp, vp, table, qsl, lens, scale, k_scales=ks, v_scales=vs)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="k_scales and v_scales go with an int8 / int4 pool"):
        paged_attention_cpu(q, kp, vp, table, qsl, lens, scale)


def test_the_pool_prices_its_scales_in():
    # SmolLM2's shape: 30 layers, 3 KV heads of 64; bf16 = 2 bytes a number
    bf16 = PagedKVCache.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    for kind, at_least in (("int8", 1.9), ("int4", 3.0)):
        b = PagedKVCache.bytes_per_block(30, 16, 3, 64, INT_KV_DTYPES[kind])
        assert b == 30 * 16 * bytes_per_token(3, 64, BITS[kind], 16)
        assert bf16 / b >= at_least
        pool = PagedKVCache(2, 4, 16, 3, 64, torch.bfloat16, kv_cache_dtype=kind)
        held = sum(t.numel() * t.element_size() for t in pool.k + pool.v + pool.k_scales + pool.v_scales)
        assert held == 4 * PagedKVCache.bytes_per_block(2, 16, 3, 64, INT_KV_DTYPES[kind])


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_compiled_step_gives_the_eager_paths_tokens(kind):
    kw = dict(dtype="float32", kv_cache_dtype=kind, num_kv_blocks=64, max_num_batched_tokens=40)
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, x):\n" * 3, "import os\n"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    compiled = LLM("tiny", **kw)
    assert compiled.llm_engine.decode_path == "compiled"
    eager = LLM("tiny", enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)] == want


def test_bad_kv_cache_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of.*int8, int4"):
        LLM("tiny", kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size"):
        LLM("tiny", kv_cache_dtype="int8", tensor_parallel_size=2)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_moving_slots_moves_what_they_hold(kind):
    """An EAGLE-2 tree's accepted path is moved to the slots after its context (draft_tree.move_slots):
    in an int pool the moved keys and values must read back as what the sources held, in a block whose
    groups are another block's."""
    from llmopt.spec.draft_tree import move_slots

    pool = PagedKVCache(2, 6, 16, 3, 64, torch.float32, kv_cache_dtype=kind)
    k, v = keys_values(40, seed=4)
    for layer in range(2):
        write_int_kv(k[:24], v[:24], pool.k[layer], pool.v[layer], pool.k_scales[layer], pool.v_scales[layer],
                     torch.arange(24) + 16, BITS[kind])          # blocks 1 and 2 (half)
        write_int_kv(k[24:] * 3, v[24:] * 3, pool.k[layer], pool.v[layer], pool.k_scales[layer],
                     pool.v_scales[layer], torch.arange(16) + 64, BITS[kind])   # block 4, larger numbers
    src, dst = [64 + 2, 64 + 5, 64 + 9], [40, 41, 42]   # into block 2, after its 8 tokens (slots 32-39)
    def read(layer, slots):
        t = torch.tensor(slots)
        keys = read_keys(pool.k[layer], pool.k_scales[layer], t // 16, BITS[kind])[torch.arange(len(t)), t % 16]
        values = read_values(pool.v[layer], pool.v_scales[layer], t // 16, BITS[kind])[torch.arange(len(t)), t % 16]
        return keys, values
    before = [read(layer, src) for layer in range(2)]
    kept = [read(layer, list(range(32, 40))) for layer in range(2)]   # block 2's own tokens
    move_slots(pool, src, dst)
    tol = {"int8": 0.02, "int4": 0.15}[kind]
    for layer in range(2):
        for got, want in zip(read(layer, dst), before[layer]):
            assert (got - want).norm() / want.norm() < tol
        for got, want in zip(read(layer, list(range(32, 40))), kept[layer]):
            assert (got - want).norm() / want.norm() < tol
