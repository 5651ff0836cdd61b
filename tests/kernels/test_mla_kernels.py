"""Paged MLA attention: absorbing the up-projections changes nothing (the torch reference
equals attention over expanded K and V), and the Triton kernel equals the reference under
TRITON_INTERPRET=1, for prompts, chunks after cached context, decodes, mixed in one batch.
Slots no token owns hold NaN, so a kernel that reads a wrong slot cannot pass."""


import pytest
import torch
from triton_checks import DEVICE, needs_triton

from llmopt.kernels import mla_attention as mla


def make_batch(seq_lens, query_lens, *, heads=4, rank=32, rope=16, block_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks) + 3, generator=g)
    pool = torch.full((sum(blocks) + 3, block_size, rank + rope), float("nan"), device=DEVICE)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    rows, used = [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks)):
        tables[i, :nb] = order[used:used + nb].int()
        used += nb
        pos = torch.arange(n)
        kv = torch.randn(n, rank + rope, generator=g).to(DEVICE)
        mla.write_latent(kv, pool, (tables[i, pos // block_size].long() * block_size + pos % block_size).to(DEVICE))
        rows.append(kv)
    q = torch.randn(sum(query_lens), heads, rank + rope, generator=g).to(DEVICE)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    return q, pool, tables.to(DEVICE), qsl, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), rows


CASES = {"prefill": ([13, 40], [13, 40]), "decode": ([1, 9, 33, 70], [1, 1, 1, 1]),
         "mixed": ([20, 35, 7, 64], [5, 1, 7, 16])}


@pytest.mark.parametrize("case", list(CASES))
def test_absorbed_reference_equals_expanded_attention(case):
    """Attention with per-head K = [W_UK c, k_pe], V = W_UV c equals the absorbed form."""
    seq_lens, query_lens = CASES[case]
    heads, rank, rope, nope, vdim = 4, 32, 16, 8, 12
    q_lat_unused, pool, tables, qsl, lens, rows = make_batch(seq_lens, query_lens, heads=heads)
    g = torch.Generator().manual_seed(1)
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=g), torch.randn(heads, vdim, rank, generator=g)
    q_nope = torch.randn(sum(query_lens), heads, nope, generator=g)
    q_pe = torch.randn(sum(query_lens), heads, rope, generator=g)
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], -1)
    out = torch.einsum("thr,hvr->thv", mla.mla_attention_ref(q, pool, tables, qsl, lens, rank, 0.3), w_uv)
    for i, (kv, n) in enumerate(zip(rows, query_lens)):
        L, s = kv.shape[0], int(qsl[i])
        k = torch.cat([torch.einsum("hnr,lr->lhn", w_uk, kv[:, :rank]), kv[:, None, rank:].expand(L, heads, rope)], -1)
        v = torch.einsum("hvr,lr->lhv", w_uv, kv[:, :rank])
        scores = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1)[s:s + n], k) * 0.3
        mask = torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None]
        want = torch.einsum("hqk,khv->qhv", scores.masked_fill(mask, float("-inf")).softmax(-1), v)
        assert torch.allclose(out[s:s + n], want, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [8, 32])
def test_triton_kernel_equals_reference(case, block_size):
    seq_lens, query_lens = CASES[case]
    q, pool, tables, qsl, lens, _ = make_batch(seq_lens, query_lens, block_size=block_size, rank=24, rope=8)
    want = mla.mla_attention_ref(q, pool, tables, qsl, lens, 24, 0.25)
    got = mla.mla_attention(q, pool, tables, qsl, lens, 24, 0.25)
    assert not got.isnan().any()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
