"""Block manager and scheduler properties: no leaked or double-freed blocks, ever.

Hypothesis drives random sequences of add / step / abort through the real engine (on
a small random-weight checkpoint, so each step is cheap) with a deliberately tiny block
pool, so preemption, prefix hits and evictions all happen, for both prefix caches (the
hash cache and the radix tree); after every operation the
ref counts must equal the block tables' holdings, and at the end every block is free.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmopt import LLM, SamplingParams
from llmopt.engine.block_manager import BlockManager

# -- the block manager alone ---------------------------------------------------------------------


def test_allocate_grow_free_and_reuse_cached_prefix():
    bm = BlockManager(num_blocks=6, block_size=4)
    toks = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    assert bm.allocate("a", len(toks))
    assert len(bm.block_tables["a"]) == 3 and bm.num_free_blocks == 3
    bm.cache_full_blocks("a", toks, num_computed=11)
    assert len(bm.cached) == 2
    # "b" shares a's first two blocks (at most len-1 tokens may hit)
    hits = bm.find_cached_prefix("b", toks[:8] + [7, 7])
    assert hits == bm.block_tables["a"][:2]
    assert bm.allocate("b", 10, hits)
    assert [bm.ref_cnt[b] for b in hits] == [2, 2]
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 6 and len(bm.cached) == 2  # free, but still cached
    # a request that needs every block evicts the cached ones (least recently freed first)
    assert bm.allocate("c", 24)
    assert len(bm.cached) == 0 and bm.num_free_blocks == 0
    assert not bm.allocate("d", 1)  # nothing left: refused, and nothing changed
    assert "d" not in bm.block_tables or bm.block_tables["d"] == []
    bm.free("c")
    bm.check_invariants()


@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append"]), st.integers(0, 7)), max_size=60))
@settings(max_examples=200, deadline=None)
def test_free_queue_keeps_lru_order_like_an_ordered_dict(ops):
    """The array-backed free queue against the OrderedDict it replaced."""
    from collections import OrderedDict

    from llmopt.engine.block_manager import FreeBlockQueue

    q, ref = FreeBlockQueue(8), OrderedDict.fromkeys(range(8))
    for op, b in ops:
        if op == "pop" and ref:
            assert q.popleft() == ref.popitem(last=False)[0]
        elif op == "remove" and b in ref:
            q.remove(b)
            del ref[b]
        elif op == "append" and b not in ref:
            q.append(b)
            ref[b] = None
        assert list(q) == list(ref) and len(q) == len(ref)


def test_a_million_blocks_cost_arrays_not_objects():
    """An object per block made LLM(num_kv_blocks=...) slow and heavy long before the KV pool."""
    import tracemalloc

    tracemalloc.start()
    bm = BlockManager(1_000_000, 16)
    used = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert used < 32 * 1_000_000  # was 259 bytes a block
    assert bm.num_free_blocks == 1_000_000 and bm.allocate("a", 40) and bm.block_tables["a"] == [0, 1, 2]


def test_exact_prefix_multiple_leaves_last_block_to_compute():
    bm = BlockManager(num_blocks=4, block_size=4)
    toks = list(range(8))
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks, 8)
    assert len(bm.find_cached_prefix("b", toks)) == 1  # (8 - 1) // 4


def test_hash_chain_distinguishes_equal_blocks_after_different_prefixes():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    assert bm.find_cached_prefix("b", [9, 9, 3, 4, 5]) == []  # same 2nd block, other parent


# -- the whole engine under random operations ---------------------------------------------------


@pytest.fixture(scope="module", params=["hash", "radix"])
def small_llm(checkpoint_dir, request):
    torch.manual_seed(0)
    return LLM(model=str(checkpoint_dir("llama-tied")), block_size=8, num_kv_blocks=12,
               max_num_seqs=4, max_num_batched_tokens=24, max_model_len=96, prefix_cache=request.param)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 40), st.integers(0, 3), st.integers(5, 14)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_no_leaked_or_double_freed_blocks(small_llm, ops):
    eng = small_llm.llm_engine
    bm = eng.block_manager
    added = []
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prefix, shared = op
            # shared beginnings so that prefix-cache hits happen (of any length: radix hits end
            # inside blocks too)
            ids = [3 + prefix] * shared + [50 + (i * 7) % 900 for i in range(plen)]
            rid = f"r{len(added)}-{id(ops)}"
            eng.add_request(rid, {"prompt_token_ids": ids},
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            added.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                if eng.has_unfinished_requests():
                    eng.step()
        else:
            if added:
                eng.abort_request(added[op[1] % len(added)])
        bm.check_invariants()
    while eng.has_unfinished_requests():
        eng.step()
        bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not bm.block_tables
