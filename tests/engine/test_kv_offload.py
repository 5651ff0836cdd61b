"""The KV offload tier (llmopt/engine/kv_offload.py, llmopt/worker/kv_tier.py).

A pool too small for the conversations it serves evicts their prefixes; with a tier below it the
returning turns load them back instead of recomputing. Held here: the tokens equal recompute's
(both prefix caches, a bf16 and an int8 pool), hits land in the tier the workload should hit,
a tier file whose bytes change or that is cut short is refused (its blocks recomputed, the
engine going on), tiers chain (host memory above disk), /metrics reports hits per tier, and bad
options are refused by name.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.bench.load import parse_metrics
from llmopt.engine.kv_offload import KVOffload, prefix_hash
from llmopt.server.process import ServerProcess
from llmopt.worker.kv_tier import BlockBytes, DiskTier, HostTier

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
# four conversations of 10 blocks of 16 tokens or more each against a 24-block pool: each has been
# pushed out of the pool by the time it returns
CONVERSATIONS = [f"Conversation {i}: " + " ".join(f"w{i}x{j}" for j in range(40)) for i in range(4)]
POOL_BLOCKS = 24


def serve_turns(llm: LLM, turns: int = 2) -> list[list[int]]:
    """Each conversation in turn, `turns` times round: its greedy tokens each time."""
    return [llm.generate([c], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(turns) for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def recomputed() -> list[list[int]]:
    return serve_turns(LLM("tiny", num_kv_blocks=POOL_BLOCKS))


def offloading(tmp_path, **kw) -> LLM:
    return LLM("tiny", num_kv_blocks=POOL_BLOCKS, kv_offloading_size=0.01, kv_offloading_path=str(tmp_path), **kw)


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_returning_turns_load_from_disk_with_recomputes_tokens(tmp_path, recomputed, prefix_cache):
    llm = offloading(tmp_path, prefix_cache=prefix_cache)
    assert serve_turns(llm) == recomputed
    m = llm.get_metrics()
    # the second turn of each conversation finds all its full blocks below the pool
    tok = llm.get_tokenizer()
    assert m["kv_offload_hits_disk"] == sum((len(tok(c).input_ids) - 1) // 16 * 16 for c in CONVERSATIONS), m
    assert m["external_prefix_cache_hits"] == m["kv_offload_hits_disk"]
    assert m["kv_offload_stored_blocks"] == m["kv_offload_blocks_disk"] > 0
    # the pool itself had lost them (the radix cache matches to the token: the conversations'
    # shared opening, less than a block, on their first turn)
    assert m["prefix_cache_hits"] < 16
    assert m["kv_offload_refused_blocks"] == 0
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    # what longest-prefix-first scheduling (scheduling_policy="lpm") sees of a prefix below the pool
    ids = tok(CONVERSATIONS[0]).input_ids
    assert bm.cached_prefix_len(ids) >= (len(ids) - 1) // 16 * 16


def test_int8_pool_round_trips_with_its_groups(tmp_path):
    """An int pool's codes mean something only with their block's key groups: both travel."""
    want = serve_turns(LLM("tiny", num_kv_blocks=POOL_BLOCKS, kv_cache_dtype="int8"))
    llm = offloading(tmp_path, kv_cache_dtype="int8")
    assert serve_turns(llm) == want
    assert llm.get_metrics()["kv_offload_hits_disk"] > 0


def test_a_hit_in_the_pool_is_not_a_tier_hit(tmp_path):
    llm = offloading(tmp_path)
    llm.generate([CONVERSATIONS[0]], GREEDY, use_tqdm=False)
    llm.generate([CONVERSATIONS[0]], GREEDY, use_tqdm=False)
    m = llm.get_metrics()
    n = len(llm.get_tokenizer()(CONVERSATIONS[0]).input_ids)
    assert m["prefix_cache_hits"] == (n - 1) // 16 * 16 and m["kv_offload_hits_disk"] == 0


def tier_file(llm: LLM) -> str:
    (tier,) = llm.llm_engine.block_manager.offload.tiers
    return tier.store.path


@pytest.mark.parametrize("damage", ["bytes", "truncate"])
def test_a_damaged_tier_file_is_refused_and_recomputed(tmp_path, recomputed, damage):
    llm = offloading(tmp_path)
    first_round = serve_turns(llm, turns=1)
    path = tier_file(llm)
    assert os.path.getsize(path) > 0 and llm.get_metrics()["kv_offload_blocks_disk"] > 0
    if damage == "bytes":  # flip a byte in every stored slot
        offload = llm.llm_engine.block_manager.offload
        with open(path, "r+b") as f:
            for slot, _ in offload.tiers[0].entries.values():
                f.seek(slot * offload.rows.nbytes + 100)
                byte = f.read(1)
                f.seek(slot * offload.rows.nbytes + 100)
                f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.truncate(path, 0)
    rest = serve_turns(llm, turns=1)
    assert first_round + rest == recomputed  # the damaged blocks were recomputed, never read as KV
    m = llm.get_metrics()
    assert m["kv_offload_refused_blocks"] > 0 and m["num_failed"] == 0, m
    llm.llm_engine.block_manager.check_invariants()


def test_tiers_chain_host_then_disk(tmp_path):
    """A GPU's tiers, run on the CPU: a full host tier moves its least recently used block down
    to disk, lookups follow the chain across both, and both give back the bytes they were given."""
    llm = LLM("tiny", num_kv_blocks=8)
    pool = llm.llm_engine.kv_cache
    for t in pool.k + pool.v:
        t.copy_(torch.randn_like(t))
    nbytes = BlockBytes(pool).nbytes
    offload = KVOffload([HostTier(2, nbytes), DiskTier(8, nbytes, str(tmp_path))], pool, 16)
    tokens = list(range(64))
    hashes = [prefix_hash(tokens, i + 1, 16) for i in range(4)]
    want = offload.rows.gather(list(range(4)))
    for b in range(4):
        offload.evicted(b, hashes[b])
    offload.store_evicted()
    assert list(offload.tiers[0].entries) == hashes[2:] and list(offload.tiers[1].entries) == hashes[:2]
    found = offload.find(None, tokens + [0], 0, 4)
    assert found == [(hashes[0], 1), (hashes[1], 1), (hashes[2], 0), (hashes[3], 0)]
    assert offload.find(None, [7] + tokens[1:], 0, 4) == []  # another first block: another chain
    offload.claim([found[0], found[3]], [6, 7])
    assert offload.load_claimed() == set()
    got = offload.rows.gather([6, 7])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[3])
    assert offload.metrics()["kv_offload_hits_disk"] == offload.metrics()["kv_offload_hits_cpu"] == 16


def test_metrics_endpoint_reports_hits_per_tier(tmp_path):
    args = ["--model", "tiny", "--device", "cpu", "--num-kv-blocks", str(POOL_BLOCKS),
            "--kv-offloading-size", "0.01", "--kv-offloading-backend", "native",
            "--kv-offloading-path", str(tmp_path)]
    with ServerProcess(args) as s:
        for _ in range(2):
            for c in CONVERSATIONS:  # each conversation twice: the second time from the tier
                r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                               json={"model": "tiny", "prompt": c, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
        text = httpx.get(f"{s.url}/metrics").text
    m = parse_metrics(text)
    assert 'llmopt:kv_offload_hits_total{model_name="tiny",tier="disk"}' in text
    assert m["llmopt:kv_offload_hits_total"] == m["llmopt:external_prefix_cache_hits_total"] > 0
    assert m["llmopt:kv_offload_stored_blocks_total"] > 0


@pytest.mark.parametrize("kw, words", [
    ({"kv_offloading_size": -1}, "finite number > 0"),
    ({"kv_offloading_size": "1"}, "must be a number"),
    ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"}, "'native'"),
    ({"kv_offloading_backend": "native"}, "set kv_offloading_size"),
    ({"kv_offloading_size": 1, "kv_offloading_path": "/no/such/folder"}, "existing folder"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "enable_prefix_caching=False"),
    ({"kv_offloading_size": 1, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative_config"),
    ({"kv_offloading_size": 1, "pipeline_parallel_size": 2}, "kv_offloading_size is not supported"),
    ({"kv_offloading_size": 1e-9}, "holds no KV block"),
])
def test_bad_offloading_options_are_named(kw, words):
    with pytest.raises((ValueError, TypeError), match=words):
        LLM("tiny", **kw)
