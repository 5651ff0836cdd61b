"""EAGLE-2 draft trees: the tree mask equals attention over each node's own path, greedy tree
verification equals plain greedy decoding, the tree sampler keeps the target's distribution,
the tree's KV slots go back to the pool, and bad tree configs are refused."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from llmopt import LLM, SamplingParams
from llmopt.layers.attention import AttentionMetadata
from llmopt.model.forward import run_model
from llmopt.model.loader import load_model
from llmopt.model.registry import model_path
from llmopt.spec.draft_tree import DraftTree, accepted_path, accepted_slot_moves, add_tree_layout
from llmopt.spec.tree import select_tree
from llmopt.spec.tree_sampler import tree_rejection_sample
from llmopt.worker.kv_cache import NoKVCache, PagedKVCache

TREE = {"method": "eagle", "model": "tiny-eagle", "num_speculative_tokens": 4,
        "tree": {"top_k": 3, "total_tokens": 10}}
PROMPTS = ["import os\nimport sys\nimport os\nimport sys\nimport",
           "def f(x):\n    return x\n\n\ndef g(x):\n    return x\n\n\ndef",
           "x = [1, 2, 3, 1, 2, 3, 1, 2,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# -- the tree mask -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return load_model(model_path("tiny"), torch.float32)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_tree_attention_equals_each_path_alone(tiny, path):
    """Verify a tree over a paged cache in one forward; each node's hidden state must equal
    the model run over (context, root, the node's ancestors, the node) from scratch. Through
    the C++ kernel (the mask as tree_bits) and through the torch path (the boolean mask)."""
    torch.manual_seed(0)
    context = torch.randint(0, 4096, (21,)).tolist()  # prefilled; the 22nd token is the root
    root = 77
    tree = DraftTree(tokens=[5, 9, 11, 13, 17, 19, 23], parents=[-1, -1, 0, 0, 1, 2, 5],
                     depths=[1, 1, 2, 2, 2, 3, 4])
    block_size, table = 4, [7, 2, 9, 0, 5, 3, 8, 1]
    cache = PagedKVCache(tiny.config.num_hidden_layers, 10, block_size, tiny.config.num_key_value_heads,
                         tiny.config.head_dim)
    with torch.inference_mode():
        run_model(tiny, cache, context, AttentionMetadata.paged([table], [0], [len(context)], block_size))
        meta = AttentionMetadata.paged([table], [len(context)], [1 + len(tree)], block_size)
        add_tree_layout(meta, [tree])
        assert meta.tree_bits is not None
        if path == "torch":
            meta.tree_bits = None  # what a tree too large for the kernel's masks takes
        hidden = run_model(tiny, cache, [root] + tree.tokens, meta)
        for i in range(-1, len(tree)):
            path, node = [], i
            while node != -1:
                path.insert(0, tree.tokens[node])
                node = tree.parents[node]
            ids = context + [root] + path
            want = run_model(tiny, NoKVCache(), ids, AttentionMetadata.uncached([len(ids)]))[-1]
            torch.testing.assert_close(hidden[i + 1], want, atol=1e-4, rtol=1e-4)


def test_tree_selection_and_paths():
    # candidates in creation order: 0, 1 under the root; 2, 3 under 0; 4 under 3
    tree = select_tree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 3], [-0.1, -2.0, -0.5, -0.3, -0.4], budget=4)
    # kept: 0, 3, 4 (its parent 3 is kept), 2; in flat order by depth, then score
    assert (tree.tokens, tree.parents, tree.depths) == ([10, 13, 12, 14], [-1, 0, 0, 1], [1, 2, 2, 3])
    assert accepted_path(tree, [10, 12, 99]) == [0, 2]
    # the path's KV moves from the tree's slots to its positions' slots: with the last token
    # at index 5, node i sits at index 6 + i and depth j belongs at index 5 + j: node 2 (index 8,
    # block 5's first slot) moves to index 7 (block 0's last slot); node 0 is in place already
    assert accepted_slot_moves([3, 0, 5], 6, [0, 2], block_size=4) == ([20], [3])
    # a child is never kept without its parent, even when it scores as high
    tree = select_tree([1, 2], [-1, 0], [-1.0, -1.0], budget=1)
    assert tree.tokens == [1]


# -- the sampler -------------------------------------------------------------------------------------
V = 10
PARENTS = [-1, -1, -1, 0, 0, 1, 3]  # three root children, two under the first, ...


def dist(seed):
    p = torch.rand(V, generator=torch.Generator().manual_seed(seed)) ** 2
    return p / p.sum()


def sample_many(sampler, n=6000):
    probs = torch.stack([dist(s) for s in range(len(PARENTS) + 1)])
    # drafts as a head would pick them, likely tokens first; the root's children skip the root's
    # favourite, so that the residual draw is exercised too
    likeliest = probs.argsort(dim=-1, descending=True)
    drafts = likeliest[0, 1:4].tolist() + likeliest[1, :2].tolist() + [int(likeliest[2, 0]), int(likeliest[4, 0])]
    g = torch.Generator().manual_seed(3)
    return probs, drafts, [sampler(probs, drafts, PARENTS, g)[0] for _ in range(n)]


def chi2_p(samples, probs):
    """Goodness of fit; tokens expected fewer than 5 times are pooled into one bin."""
    counts = np.bincount(samples, minlength=V)
    probs = probs.double().numpy()
    expected = probs / probs.sum() * len(samples)
    expected *= len(samples) / expected.sum()  # exactly, for scipy's check of the totals
    big = expected >= 5
    if big.all():
        return chisquare(counts, expected).pvalue
    return chisquare(np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())).pvalue


def test_tree_sampler_keeps_the_target_distribution():
    probs, drafts, runs = sample_many(tree_rejection_sample)
    assert chi2_p([r[0] for r in runs], probs[0]) > 1e-3
    # after accepting root child c, the next token follows p at node c
    for node in (0, 1, 2):
        after = [r[1] for r in runs if r[0] == drafts[node]]
        assert len(after) > 300
        assert chi2_p(after, probs[node + 1]) > 1e-3
    # and two levels down, under node 0 then node 3
    deep = [r[2] for r in runs if r[:2] == [drafts[0], drafts[3]]]
    assert len(deep) > 100 and chi2_p(deep, probs[3 + 1]) > 1e-3


def test_negative_control_first_child_always_accepted_fails():
    def greedy_first(probs, drafts, parents, g):
        return [drafts[0]], [0]

    probs, _, runs = sample_many(greedy_first, n=2000)
    assert chi2_p([r[0] for r in runs], probs[0]) < 1e-6


def test_greedy_tree_follows_the_argmax():
    probs = torch.full((len(PARENTS) + 1, V), 0.01)
    for row, best in enumerate([5, 0, 3, 0, 8, 0, 0, 6]):
        probs[row, best] = 1.0
    drafts = [2, 5, 9, 1, 3, 7, 8]  # root children 2, 5, 9: 5 matches; under it (node 1) only 7
    emitted, path = tree_rejection_sample(probs, drafts, PARENTS, greedy=True)
    assert (emitted, path) == ([5, 3], [1])  # node 1's argmax is 3, not its child 7
    drafts[5] = 3  # now node 1's child matches: follow it, then node 5's argmax (a leaf)
    assert tree_rejection_sample(probs, drafts, PARENTS, greedy=True) == ([5, 3, 0], [1, 5])


# -- the engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tiny_llm):
    return tokens(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_tree_greedy_equals_plain_greedy_and_frees_its_slots(plain):
    llm = LLM(model="tiny", speculative_config=TREE, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == plain[:1]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts"] > 0
    assert m["spec_decode_num_draft_tokens"] <= 10 * m["spec_decode_num_drafts"]
    per_pos = [m[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(4)]
    assert sum(per_pos) == m["spec_decode_num_accepted_tokens"] > 0
    assert per_pos == sorted(per_pos, reverse=True)
    eng = llm.llm_engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks  # every tree slot back in the pool


@pytest.mark.parametrize("spec", [TREE, {"method": "eagle", "model": "tiny-eagle", "num_speculative_tokens": 4}],
                         ids=["tree", "chain"])
def test_verification_takes_the_compiled_step_and_keeps_plain_greedy(plain, spec, monkeypatch):
    """Verification steps (a chain, or a tree under its mask) run through the compiled decode
    step, one C++ call, and still give plain greedy's tokens; the eager path gives the same."""
    llm = LLM(model="tiny", speculative_config=spec, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    assert llm.llm_engine.decode_path == "compiled"
    assert llm.llm_engine.proposer.compiled is not None  # the head drafts through it too
    seen = []
    real = runner.backend.forward
    monkeypatch.setattr(runner.backend, "forward", lambda ids, meta: seen.append(meta) or real(ids, meta))
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    verifying = [m for m in seen if not m.is_decode]
    assert verifying and all(max(m.query_lens) > 1 for m in verifying)
    if "tree" in spec:
        assert any(m.tree_bits is not None for m in verifying)
    eager = LLM(model="tiny", speculative_config=spec, enable_prefix_caching=False, enforce_eager=True)
    assert tokens(eager.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain


def test_tree_under_a_tight_pool_prefix_caching_and_preemption(plain):
    tight = LLM(model="tiny", speculative_config=TREE, block_size=8, num_kv_blocks=16,
                max_num_batched_tokens=24)
    assert tokens(tight.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    assert tokens(tight.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain  # prefix-cache hits
    eng = tight.llm_engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_tree_logprobs_are_the_targets(tiny_llm):
    """Each emitted token's logprob comes from its parent node's row: as plain decoding reports."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    want = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    got = LLM(model="tiny", speculative_config=TREE).generate(PROMPTS, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)


def test_tree_sampling_is_seeded_and_returns_its_blocks():
    llm = LLM(model="tiny", speculative_config=TREE, block_size=8)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30, ignore_eos=True)
              for s in range(3)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(t) for t in tokens(outs)] == [30] * 3
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == tokens(outs)
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    eng = llm.llm_engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("tree,error,match", [
    ([3, 10], TypeError, "must be a dict"),
    ({"top_k": 3, "width": 2}, ValueError, "unknown keys"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"top_k": 2, "total_tokens": 100}, ValueError, "total_tokens"),
    ({"total_tokens": 2.5}, ValueError, "total_tokens"),
])
def test_bad_tree_configs(tree, error, match):
    with pytest.raises(error, match=match):
        LLM(model="tiny", speculative_config={**TREE, "tree": tree})


def test_tree_only_for_eagle():
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(model="tiny", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "tree": {}})


@pytest.mark.slow  # 1500 sampled requests through trees (the sampler alone is tested above, in a second)
def test_sampled_tree_early_token_matches_plain_sampling(tiny_llm):
    from test_spec_engine import N_SAMPLES, chi2_p as two_sample_p, early_token_counts

    plain = early_token_counts(tiny_llm, N_SAMPLES, seed0=0)
    llm = LLM(model="tiny", speculative_config=TREE, max_num_seqs=256)
    treed = early_token_counts(llm, N_SAMPLES, seed0=2 * N_SAMPLES)
    assert llm.get_metrics()["spec_decode_num_drafts"] > N_SAMPLES / 10  # trees really ran
    assert two_sample_p(plain, treed) > 0.001


def test_a_reduced_draft_vocabulary_drafts_only_from_it(tmp_path, plain):
    import shutil

    head = tmp_path / "tiny-eagle-small-vocab"
    shutil.copytree(model_path("tiny-eagle"), head)
    vocab = list(range(0, 4096, 3))
    (head / "draft_vocab.json").write_text(str(vocab))
    llm = LLM(model="tiny", speculative_config={**TREE, "model": str(head)})
    seen = []
    propose = llm.llm_engine.proposer.propose

    def spy(seqs, ks, block_tables):
        out = propose(seqs, ks, block_tables)
        seen.extend(t for drafts, _ in out for t in drafts)
        return out

    llm.llm_engine.proposer.propose = spy
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    assert seen and set(seen) <= set(vocab)
    (head / "draft_vocab.json").write_text("[1, 5000]")
    with pytest.raises(ValueError, match="draft_vocab.json"):
        LLM(model="tiny", speculative_config={**TREE, "model": str(head)})
