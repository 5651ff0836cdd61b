"""The engine's CPU attention paths over the block pool (the torch path, and the C++ kernel where
it builds) equal the paged-attention reference."""

import torch

from llmopt.kernels.paged_attention_ref import paged_attention_ref
from llmopt.layers.attention import AttentionMetadata, attention
from llmopt.worker.kv_cache import PagedKVCache


def test_torch_path_equals_reference_on_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    bs, Hkv, G, D, nblocks = 8, 2, 3, 16, 40
    cache = PagedKVCache(1, nblocks, bs, Hkv, D)
    # three sequences: a whole prompt, a chunk after cached context, a decode
    query_lens, context_lens = [11, 6, 1], [0, 13, 20]
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables, used = [], 0
    for q, c in zip(query_lens, context_lens):
        n = -(-(q + c) // bs)
        tables.append(perm[used:used + n])
        used += n
    # fill the cached context with known keys/values, as earlier steps would have
    for t, c in zip(tables, context_lens):
        for p in range(c):
            cache.k[0][t[p // bs], p % bs] = torch.randn(Hkv, D, generator=g)
            cache.v[0][t[p // bs], p % bs] = torch.randn(Hkv, D, generator=g)
    batch = AttentionMetadata.paged(tables, context_lens, query_lens, bs)
    T = sum(query_lens)
    q = torch.randn(T, Hkv * G, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    for window, kernel in ((None, "torch"), (5, "torch"), (None, "cpu"), (5, "cpu")):
        cache.use_attention(kernel)
        got = attention(q, k, v, batch, cache, 0, scale=D ** -0.5, window=window)
        want = paged_attention_ref(q, cache.k[0], cache.v[0], batch.block_table_tensor,
                                   batch.query_start_loc, batch.seq_lens_tensor, D ** -0.5, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_stale_nan_slots_never_reach_a_request():
    """A pool's unwritten slots and the padding of a decode group are never read: a NaN left
    in a freed block by an earlier request does not reach the next one (the pool is
    allocated empty, not zeroed, so this is what keeps garbage out)."""
    bs, Hkv, G, D = 8, 2, 3, 16
    cache = PagedKVCache(1, 12, bs, Hkv, D)
    cache.k[0].fill_(float("nan"))
    cache.v[0].fill_(float("nan"))
    g = torch.Generator().manual_seed(1)
    # two decoding sequences of different lengths in one group: the shorter one is padded
    lens, tables = [5, 19], [[3], [7, 1, 9]]
    for t, n in zip(tables, lens):
        for p in range(n - 1):
            cache.k[0][t[p // bs], p % bs] = torch.randn(Hkv, D, generator=g)
            cache.v[0][t[p // bs], p % bs] = torch.randn(Hkv, D, generator=g)
    batch = AttentionMetadata.paged(tables, [n - 1 for n in lens], [1, 1], bs)
    q = torch.randn(2, Hkv * G, D, generator=g)
    k, v = torch.randn(2, Hkv, D, generator=g), torch.randn(2, Hkv, D, generator=g)
    cache.use_attention("torch")  # the torch path (the C++ kernel's NaN test is tests/kernels/test_cpu_kernels.py)
    got = attention(q, k, v, batch, cache, 0, scale=D ** -0.5)
    assert torch.isfinite(got).all()
    want = paged_attention_ref(q, cache.k[0], cache.v[0], batch.block_table_tensor,
                               batch.query_start_loc, batch.seq_lens_tensor, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
