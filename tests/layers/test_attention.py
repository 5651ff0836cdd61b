"""The CPU attention path (grouped matmuls over tiles of queries) equals the definition."""

import pytest
import torch

from llmopt.layers.attention import QUERY_TILE, causal_mask, sequence_attention


def reference(q, k, v, scale, window):
    """Softmax attention written out: every query head against its kv head's keys, in fp64."""
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~causal_mask(n, L, window, q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


SHAPES = [
    # (new queries, keys, window): whole prompts, chunks after cached context, single decodes,
    # tile edges, sliding windows narrower and wider than a tile
    (1, 1, None), (1, 300, None), (QUERY_TILE, QUERY_TILE, None), (QUERY_TILE + 1, QUERY_TILE + 1, None),
    (3 * QUERY_TILE - 5, 3 * QUERY_TILE - 5, None), (130, 500, None), (7, 300, None),
    (200, 200, 50), (5, 300, 17), (64, 64, 1), (150, 400, QUERY_TILE * 2 + 3),
]


@pytest.mark.parametrize("n,L,window", SHAPES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_cpu_attention_equals_definition(n, L, window, heads, kv_heads):
    g = torch.Generator().manual_seed(n * 1000 + L)
    q = torch.randn(n, heads, 32, generator=g)
    k, v = torch.randn(L, kv_heads, 32, generator=g), torch.randn(L, kv_heads, 32, generator=g)
    out = sequence_attention(q, k, v, 0.2, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.2, window), atol=2e-6, rtol=1e-5)


def test_cpu_attention_reads_strided_keys():
    """The contiguous cache hands in per-slot strips transposed: [L, Hkv, D] views, not copies."""
    g = torch.Generator().manual_seed(0)
    strip = torch.randn(2, 100, 32, generator=g)           # [Hkv, max_len, D]
    k, v = strip[:, :90].transpose(0, 1), strip.flip(1)[:, :90].transpose(0, 1)
    q = torch.randn(40, 6, 32, generator=g)
    torch.testing.assert_close(sequence_attention(q, k, v, 0.2).double(), reference(q, k, v, 0.2, None),
                               atol=2e-6, rtol=1e-5)


def test_cpu_attention_in_bfloat16_stays_close():
    """Scores and softmax run in fp32 for low-precision models, as fused kernels accumulate."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(150, n, 64, generator=g).bfloat16() for n in (6, 2, 2))
    out = sequence_attention(q, k, v, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.125, None), atol=3e-2, rtol=2e-2)
