"""PagedAttention: the torch reference equals dense causal attention, and both Triton
kernels (decode, prefill) equal the reference, under TRITON_INTERPRET=1 on CPU.

Every batch scatters its sequences' blocks over the pool in shuffled order and fills
every slot no token owns with NaN, so a kernel that reads a wrong slot cannot pass.
"""


import pytest
import torch
import torch.nn.functional as F
from triton_checks import DEVICE, DTYPES, needs_triton

from llmopt.kernels import paged_attention as pa
from llmopt.worker.kv_cache import write_kv  # the pool's write, as the engine does it before attention

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_batch(seq_lens, query_lens, *, num_kv_heads=2, group=2, head_dim=16, block_size=8,
               dtype=torch.float32, contiguous_blocks=False, spare_blocks=3, seed=0):
    """A paged batch: pool, block tables, the flat queries and their offsets.

    Keys and values of every token (cached context and new ones alike) are written with
    `write_kv`, as the engine does before attention. Also returns the dense per-sequence
    keys/values so the reference can be checked against plain attention.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    if contiguous_blocks:
        order = torch.arange(num_blocks)
    else:
        order = torch.randperm(num_blocks, generator=g)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[i, :nb] = order[used:used + nb].int()
        used += nb
        pos = torch.arange(n)
        slot_mapping = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
        write_kv(k, v, k_cache, v_cache, slot_mapping.to(DEVICE))
        dense_k.append(k)
        dense_v.append(v)

    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=g).to(DEVICE, dtype)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables.to(DEVICE),
                query_start_loc=query_start_loc.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                scale=head_dim ** -0.5), dense_k, dense_v


def reference(b, window=None):
    return pa.paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                  b["query_start_loc"], b["seq_lens"], b["scale"], window)


def decode(b, window=None):
    return pa.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                     b["seq_lens"], b["scale"], window)


def prefill(b, window=None):
    return pa.paged_attention_prefill(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],
                                      b["query_start_loc"], b["seq_lens"], b["scale"], window)


def assert_close(actual, expected, dtype):
    assert actual.dtype == dtype and not actual.isnan().any()
    torch.testing.assert_close(actual, expected, atol=TOL[dtype], rtol=TOL[dtype])


# ---- the reference against plain dense attention ------------------------------------------

@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_dense_causal_attention(group, window):
    """Blocks laid out in order: each sequence's cache is its dense keys, so SDPA is the truth.

    The batch holds a whole prompt, a chunk after cached context and a decode; each
    sequence's queries are the last rows of a full causal attention over the sequence.
    """
    seq_lens, query_lens = [19, 30, 9], [19, 6, 1]
    b, dense_k, dense_v = make_batch(seq_lens, query_lens, group=group, block_size=8,
                                     contiguous_blocks=True)
    out = reference(b, window)
    g = torch.Generator().manual_seed(1)
    starts = b["query_start_loc"].tolist()
    for i, (n, m) in enumerate(zip(seq_lens, query_lens)):
        # The queries of the whole sequence, with this step's queries as the last m rows.
        q_full = torch.randn(n, *b["q"].shape[1:], generator=g).to(DEVICE)
        q_full[n - m:] = b["q"][starts[i]:starts[i + 1]]
        pos = torch.arange(n, device=DEVICE)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        dense = F.scaled_dot_product_attention(
            q_full.transpose(0, 1), dense_k[i].transpose(0, 1), dense_v[i].transpose(0, 1),
            attn_mask=mask, scale=b["scale"], enable_gqa=True).transpose(0, 1)
        if window is None:  # the plain is_causal path too, not only our own mask
            causal = F.scaled_dot_product_attention(
                q_full.transpose(0, 1), dense_k[i].transpose(0, 1), dense_v[i].transpose(0, 1),
                is_causal=True, scale=b["scale"], enable_gqa=True).transpose(0, 1)
            torch.testing.assert_close(dense, causal)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], dense[n - m:],
                                   atol=1e-5, rtol=1e-5)


def test_write_kv_puts_each_token_in_its_slot():
    b, dense_k, dense_v = make_batch([11, 3], [11, 3], block_size=8)
    for i, n in enumerate([11, 3]):
        for p in range(n):
            block = int(b["block_tables"][i, p // 8])
            assert torch.equal(b["k_cache"][block, p % 8], dense_k[i][p])
            assert torch.equal(b["v_cache"][block, p % 8], dense_v[i][p])


# ---- the kernels against the reference ------------------------------------------------------

# Lengths 1, not a multiple of any block size, exactly two blocks of 16, and several tiles.
DECODE_SEQ_LENS = [1, 7, 32, 45]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_kernel_equals_reference(block_size, group, head_dim, dtype):
    b, _, _ = make_batch(DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), group=group,
                         head_dim=head_dim, block_size=block_size, dtype=dtype)
    assert_close(decode(b), reference(b), dtype)


@needs_triton
@pytest.mark.parametrize("keys_per_tile", [16, 32, 64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_tiles_of_any_number_of_keys(block_size, keys_per_tile):
    """A tile of keys spans several blocks or part of one; contexts of several tiles, one short."""
    b, _, _ = make_batch([1, 64, 130, 200], [1] * 4, group=4, head_dim=16, block_size=block_size)
    got = pa.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                    b["scale"], 37, keys_per_tile=keys_per_tile)
    assert_close(got, reference(b, 37), torch.float32)
    assert_close(pa.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                           b["scale"], keys_per_tile=keys_per_tile), reference(b), torch.float32)


# One batch with everything the engine mixes in a step: a whole prompt longer than a block,
# a prompt chunk after 21 cached tokens, a decode, and a one-token prompt.
MIXED_SEQ_LENS, MIXED_QUERY_LENS = [19, 33, 9, 1], [19, 12, 1, 1]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_kernel_equals_reference_on_a_mixed_batch(block_size, group, head_dim, dtype):
    b, _, _ = make_batch(MIXED_SEQ_LENS, MIXED_QUERY_LENS, group=group,
                         head_dim=head_dim, block_size=block_size, dtype=dtype)
    assert_close(prefill(b), reference(b), dtype)


@needs_triton
@pytest.mark.parametrize("block_size", [8, 32])
def test_chunked_prefill_equals_one_shot_prefill(block_size):
    """A 40-token prompt in chunks of 16, 16, 8 gives the same outputs as in one go."""
    b, _, _ = make_batch([40], [40], group=2, block_size=block_size)
    whole = prefill(b)
    assert_close(whole, reference(b), torch.float32)
    done = 0
    for chunk in (16, 16, 8):
        done += chunk
        step = dict(b, q=b["q"][done - chunk:done],
                    query_start_loc=torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE),
                    seq_lens=torch.tensor([done], dtype=torch.int32, device=DEVICE))
        torch.testing.assert_close(prefill(step), whole[done - chunk:done], atol=1e-5, rtol=1e-5)


@needs_triton
def test_prefill_with_several_query_tiles():
    """70 new queries need two 64-row tiles; the second starts past cached context."""
    b, _, _ = make_batch([75, 20], [70, 20], group=2, block_size=16)
    assert_close(prefill(b), reference(b), torch.float32)


@needs_triton
@pytest.mark.parametrize("block_size", [8, 16])
def test_draft_tree_masks(block_size):
    """EAGLE-2 verification: two trees (each a root and its nodes, every node seeing the
    context and its own ancestors) beside a causal chunk and a decode, through the dispatcher."""
    from llmopt.spec.draft_tree import tree_bits

    trees = [[-1, -1, 0, 0, 1, 2, 5, 5, 3], [-1, 0, 1, -1, 3, 2]]
    b, _, _ = make_batch([30, 20, 9, 41], [10, 7, 1, 7], group=2, block_size=block_size)
    bits = torch.tensor(tree_bits(trees[0]) + [-1] * 7 + [-1] + tree_bits(trees[1]), device=DEVICE)
    want = pa.paged_attention_ref(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["query_start_loc"],
                                  b["seq_lens"], b["scale"], tree_bits=bits)
    got = pa.paged_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["query_start_loc"],
                             b["seq_lens"], b["scale"], tree_bits=bits)
    assert_close(got, want, torch.float32)
    assert not torch.allclose(want, reference(b), atol=1e-3)  # the masks changed what rows see


@needs_triton
@pytest.mark.parametrize("window", [1, 5, 16, 1000])
@pytest.mark.parametrize("block_size", [8, 16])
def test_sliding_window(block_size, window):
    """Windows of one token, shorter than a block, one tile, and longer than any sequence."""
    b, _, _ = make_batch(MIXED_SEQ_LENS + [45], MIXED_QUERY_LENS + [20],
                         group=2, block_size=block_size)
    assert_close(prefill(b, window), reference(b, window), torch.float32)
    d, _, _ = make_batch(DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), group=2,
                         block_size=block_size)
    assert_close(decode(d, window), reference(d, window), torch.float32)


@needs_triton
def test_dispatcher_picks_decode_only_when_every_query_len_is_one(monkeypatch):
    calls = []
    for name in ("paged_attention_decode", "paged_attention_prefill"):
        kernel = getattr(pa, name)
        monkeypatch.setattr(pa, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))

    for seq_lens, query_lens, expected in [(DECODE_SEQ_LENS, [1] * 4, "paged_attention_decode"),
                                           (MIXED_SEQ_LENS, MIXED_QUERY_LENS,
                                            "paged_attention_prefill")]:
        b, _, _ = make_batch(seq_lens, query_lens, group=2)
        out = pa.paged_attention(**b)
        assert calls[-1] == expected
        assert_close(out, reference(b), torch.float32)


@needs_triton
def test_unsupported_shapes_are_refused():
    b, _, _ = make_batch([5], [1], head_dim=16, block_size=8)
    with pytest.raises(AssertionError, match="block_size"):
        decode(dict(b, k_cache=b["k_cache"][:, :4], v_cache=b["v_cache"][:, :4]))
    with pytest.raises(AssertionError, match="head_dim"):
        decode(dict(b, q=b["q"][..., :8], k_cache=b["k_cache"][..., :8],
                    v_cache=b["v_cache"][..., :8]))
