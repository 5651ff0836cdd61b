"""The radix-tree prefix cache (prefix_cache="radix") against the hash cache and no cache at all.

Greedy tokens must be the same three ways on multi-turn chat, few-shot prompts and a shared
system prompt (the KV the tree hands out, copied blocks included, is the KV a cold run computes),
and the tree must reuse at least the hash cache's tokens, more where prefixes end inside a block.
Then the tree alone: splits, copy-on-write, LRU eviction of unlocked leaves. (Its invariants under
random add / step / abort on a tiny pool: tests/engine/test_block_manager.py, run for both caches.)
"""

import pytest

from llmopt import LLM, SamplingParams
from llmopt.cli import build_parser, engine_kwargs
from llmopt.engine.radix_cache import RadixCache

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BS = 16


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_clean(llm):
    """After every request ended: nothing held, nothing locked, every block free or evictable;
    then the cache emptied (the next workload starts cold) and every block in the free queue."""
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert not bm.block_tables and bm.num_free_blocks == bm.num_blocks
    if isinstance(bm, RadixCache):
        assert not bm.last_node and all(n.lock_ref == 0 for n in bm._nodes())
    bm.reset_prefix_cache()
    bm.check_invariants()
    assert len(bm.free_queue) == bm.num_blocks and bm.num_cached_blocks == 0


@pytest.fixture(scope="module")
def tok():
    return LLM(model="tiny", num_kv_blocks=8).tokenizer


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def run_rounds(llm, rounds):
    """Each round is one generate call (later rounds can hit what earlier ones cached); a
    round is a list of prompts, or a function of the outputs so far (multi-turn chat)."""
    outs = []
    for r in rounds:
        prompts = r(outs) if callable(r) else r
        outs += tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    return outs


def workloads(tok):
    bos = [tok.bos_token_id]
    system = bos + ids(tok, "# You are a careful Python assistant. Answer with code only, typed.\n")
    shared = [[{"prompt_token_ids": system + ids(tok, q)}] for q in
              ("def add(a, b):", "class Stack:", "def fib(n):", "import os\ndef walk(p):")]
    shots = bos + ids(tok, "# sort: sorted(xs)\n# reverse: xs[::-1]\n# sum: sum(xs)\n# ")
    few_shot = [[{"prompt_token_ids": shots + ids(tok, q)}] for q in ("max:", "min:", "len:")]

    def turn(i, question):
        def prompt(outs):  # the conversation so far, its last answer included, then a new question
            before = [] if i == 0 else chat_prompt[i - 1] + outs[-1]
            chat_prompt[i] = (before or system) + ids(tok, question)
            return [{"prompt_token_ids": chat_prompt[i]}]
        return prompt

    chat_prompt = {}
    chat = [turn(i, q) for i, q in enumerate(("\n# user: a stack?\n", "\n# user: now a queue\n",
                                              "\n# user: add a peek\n"))]
    return {"shared system prompt": shared, "few-shot": few_shot, "multi-turn chat": chat}, system, shots


def test_radix_equals_hash_equals_no_cache_and_reuses_more(tok):
    loads, system, shots = workloads(tok)
    assert len(system) % BS and len(shots) % BS  # prefixes that end inside a block
    llms = {kind: LLM(model="tiny", block_size=BS, num_kv_blocks=64, enable_prefix_caching=kind != "off",
                      prefix_cache="radix" if kind == "radix" else "hash") for kind in ("off", "hash", "radix")}
    for name, rounds in loads.items():
        got, hits = {}, {}
        for kind, llm in llms.items():
            before = llm.get_metrics()["prefix_cache_hits"]
            got[kind] = run_rounds(llm, rounds)
            hits[kind] = llm.get_metrics()["prefix_cache_hits"] - before
            assert_clean(llm)
        assert got["radix"] == got["hash"] == got["off"], name
        assert hits["radix"] > hits["hash"] > 0, (name, hits)


def test_hits_counted_in_tokens_to_the_token(tok):
    llm = LLM(model="tiny", block_size=BS, num_kv_blocks=32, prefix_cache="radix")
    first = [1] + ids(tok, "def parse(text):\n    return text.split()\n")
    assert len(first) % BS
    a = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)[0]
    again = first + a.outputs[0].token_ids[:5] + [42]  # the first request's prompt and output, and more
    b = llm.generate([{"prompt_token_ids": again}], GREEDY, use_tqdm=False)[0]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, len(first) + 5)
    m = llm.get_metrics()
    assert (m["prefix_cache_queries"], m["prefix_cache_hits"]) == (len(first) + len(again), len(first) + 5)
    # the same prompt once more: everything but its last token
    c = llm.generate([{"prompt_token_ids": again}], GREEDY, use_tqdm=False)[0]
    assert c.num_cached_tokens == len(again) - 1 and c.outputs[0].token_ids == b.outputs[0].token_ids
    assert_clean(llm)


def test_preemption_and_chunked_prefill_with_shared_prefixes(tok):
    system = [1] + ids(tok, "# Utilities shared by every request in this file.\nimport math\n")
    prompts = [{"prompt_token_ids": system + ids(tok, q)} for q in
               ("def area(r):", "def norm(v):", "class Point:", "def mean(xs):", "def clamp(x):")]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = tokens(LLM(model="tiny", enable_prefix_caching=False).generate(prompts, params, use_tqdm=False))
    # 12 blocks of 8 cannot hold five growing sequences; 10-token steps chunk every prompt
    for knobs in (dict(num_kv_blocks=12, max_num_batched_tokens=64), dict(num_kv_blocks=64, max_num_batched_tokens=10)):
        llm = LLM(model="tiny", block_size=8, prefix_cache="radix", **knobs)
        outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
        assert tokens(outs) == expected, knobs
        m = llm.get_metrics()
        assert m["prefix_cache_hits"] >= 4 * len(system)
        assert (m["num_preemptions"] > 0) == (knobs["num_kv_blocks"] == 12)
        assert_clean(llm)


@pytest.mark.parametrize("spec", [{"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 3},
                                  {"method": "eagle", "model": "tiny-eagle", "num_speculative_tokens": 3}])
def test_speculative_decoding_reads_copied_blocks(tok, spec):
    """Draft KV and EAGLE's per-slot features are copied with the target's blocks."""
    system = [1] + ids(tok, "# A module of small helpers for strings.\n")
    prompts = [{"prompt_token_ids": system + ids(tok, q)} for q in ("def upper(s):", "def strip(s):")]
    plain = LLM(model="tiny", enable_prefix_caching=False)
    expected = tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(model="tiny", block_size=BS, prefix_cache="radix", speculative_config=spec)
    outs = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert tokens(outs) == expected
    assert outs[1].num_cached_tokens >= len(system) > len(system) // BS * BS  # a block was copied
    assert_clean(llm)


def test_lpm_admits_the_longest_cached_prefix_first(tok):
    cached = [1] + ids(tok, "# Helpers for parsing configuration files, one per format.\n")
    for policy, order in (("fcfs", [0, 1, 2]), ("lpm", [2, 1, 0])):
        llm = LLM(model="tiny", block_size=BS, prefix_cache="radix", max_num_seqs=1, scheduling_policy=policy)
        llm.generate([{"prompt_token_ids": cached}], GREEDY, use_tqdm=False)
        prompts = [{"prompt_token_ids": [1] + ids(tok, "class Unrelated:\n    pass\n")},
                   {"prompt_token_ids": cached[:9] + ids(tok, "def other():")},
                   {"prompt_token_ids": cached + ids(tok, "def load_toml(path):")}]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time) == order, policy
        assert [o.num_cached_tokens for o in outs[:2]] == [1, 9] and outs[2].num_cached_tokens >= len(cached)
        assert_clean(llm)


# -- the tree alone ----------------------------------------------------------------------------


def test_split_copy_on_write_and_borrowed_blocks():
    bm = RadixCache(num_blocks=10, block_size=4)
    a = list(range(100, 110))  # 10 tokens: blocks of 4, 4, 2
    assert bm.allocate("a", 10, bm.find_cached_prefix("a", a))
    bm.cache_full_blocks("a", a, 10)
    b = a[:6] + [7, 7, 7]  # parts from a inside a's second block
    match = bm.find_cached_prefix("b", b)
    assert (match.num_tokens, match.blocks, match.copy_src) == (6, [bm.block_tables["a"][0]], bm.block_tables["a"][1])
    assert bm.find_cached_prefix("h", b).num_tokens == 6 and len(list(bm._nodes())) == 1  # a lookup changes nothing
    assert bm.allocate("b", 9, match)
    assert bm.take_block_copies() == [(bm.block_tables["a"][1], bm.block_tables["b"][1])]
    bm.cache_full_blocks("b", b, 9)
    bm.check_invariants()
    upper = bm.root.children[100]
    assert (upper.end, sorted(c.key[0] for c in upper.children.values())) == (6, [7, 106])
    lower = upper.children[106]
    assert not lower.owns_first and lower.blocks[0] == upper.blocks[-1]  # the split left one block to both
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 5  # a's 3 blocks and b's 2 own ones


def test_lru_evicts_unlocked_leaves_only():
    bm = RadixCache(num_blocks=8, block_size=4)
    prompt = {rid: [first + i for i in range(8)] for rid, first in (("x", 10), ("y", 20), ("z", 30))}
    for rid, toks in prompt.items():  # three 8-token prompts, 2 blocks each
        assert bm.allocate(rid, 8, bm.find_cached_prefix(rid, toks))
        bm.cache_full_blocks(rid, toks, 8)
    bm.free("x")
    bm.free("z")  # y is still running
    m = bm.find_cached_prefix("x2", prompt["x"] + [1])  # x again: now more recently used than z
    assert m.num_tokens == 8 and bm.allocate("x2", 9, m)
    bm.free("x2")
    assert bm.num_free_blocks == 6 and len(bm.free_queue) == 2  # and x's, z's blocks evictable
    assert bm.allocate("w", 16)  # 4 blocks: the 2 free ones, then z's (least recently used)
    found = {rid: bm.find_cached_prefix("q", toks + [1]).num_tokens for rid, toks in prompt.items()}
    assert found == {"x": 8, "y": 8, "z": 0}
    assert not bm.allocate("v", 9)  # 3 blocks, only x's 2 evictable (y is locked): refused
    bm.check_invariants()
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 4


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("knobs, words", [
    (dict(prefix_cache="trie"), ["prefix_cache", "'hash'", "'radix'", "'trie'"]),
    (dict(prefix_cache=None), ["prefix_cache", "'hash'", "'radix'"]),
    (dict(scheduling_policy="sjf"), ["scheduling_policy", "'fcfs'", "'priority'", "'lpm'"]),
    (dict(prefix_cache="radix", enable_prefix_caching=False), ["radix", "enable_prefix_caching=True"]),
    (dict(scheduling_policy="lpm", enable_prefix_caching=False), ["lpm", "enable_prefix_caching=True"]),
    (dict(prefix_cache="radix", tensor_parallel_size=2), ["prefix_cache='radix'", "tensor_parallel_size"]),
])
def test_bad_prefix_cache_settings_are_refused_before_loading(knobs, words):
    with pytest.raises(ValueError) as e:
        LLM(model="tiny", **knobs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cli_flags_use_vllm_spelling(capsys):
    args = build_parser().parse_args(["generate", "x", "--prefix-cache", "radix", "--scheduling-policy", "lpm"])
    assert engine_kwargs(args)["prefix_cache"] == "radix" and engine_kwargs(args)["scheduling_policy"] == "lpm"
    assert engine_kwargs(build_parser().parse_args(["generate", "x"]))["prefix_cache"] == "hash"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--prefix-cache", "trie"])
    assert "invalid choice" in capsys.readouterr().err
