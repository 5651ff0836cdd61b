"""The speculative-decoding views of lesson 05, checked against what the engine itself reports.

The token stream rebuilt from the trace must be the request's output, token for token; the
per-position counts must be the engine's spec-decode counters; the distribution check must
pass for the rejection sampler and fail for a verifier that accepts everything.
"""

import math

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from transformers import AutoTokenizer  # noqa: E402

from llmopt import SamplingParams, model_path  # noqa: E402
from llmopt.bench import make_requests  # noqa: E402
from llmopt.bench.spec import bench_spec, predicted_speedup  # noqa: E402
from llmopt.viz import setup_notebook  # noqa: E402
from traced import make_llm  # noqa: E402  (tests/viz/traced.py)
from llmopt.viz.spec import (  # noqa: E402
    KINDS,
    SpecTokens,
    acceptance_by_position,
    acceptance_sweep,
    position_figure,
    run_spec,
    spec_tokens_text,
    spec_widget,
    speedup_figure,
    speedup_model_figure,
    speedup_model_rows,
    speedup_model_widget,
    speedup_rows,
    step_rows,
    sweep_figure,
    token_sources,
)
from llmopt.viz.spec_distribution import (  # noqa: E402
    always_accept,
    chi_square,
    distribution_figure,
    distribution_rows,
    first_token_counts,
    top_bins,
)

setup_notebook()
NGRAM = {"method": "ngram", "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": "tiny-draft"}
TOKENIZER = AutoTokenizer.from_pretrained(str(model_path("tiny")))
# code that repeats itself: prompt lookup finds runs to propose, and the target accepts some
REPEATING = {"prompt_token_ids": TOKENIZER("def f(x):\n" + "    x = x + 1\n" * 4)["input_ids"]}
PROMPTS = [REPEATING, {"prompt_token_ids": [1] + list(range(300, 330))}]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def draft_run():
    return run_spec(make_llm, PROMPTS, DRAFT, k=3, temperature=0.0, max_tokens=20)


def plain_tokens(prompts, max_tokens):
    outs = make_llm().generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# -- the token stream -------------------------------------------------------------------------------
def test_token_sources_rebuild_each_output(draft_run):
    m = draft_run.metrics
    totals = dict.fromkeys(KINDS, 0)
    for out in draft_run.outputs:
        rows = token_sources(draft_run.trace, out)
        assert [r["token_id"] for r in rows if r["kind"] != "rejected"] == out.outputs[0].token_ids
        assert rows[0]["kind"] == "target"  # the first token comes from the prompt's prefill
        for r in rows:
            totals[r["kind"]] += 1
        # within a step: accepted drafts, then rejected ones, then the target's own token
        order = {"accepted": 0, "rejected": 1, "replacement": 2, "bonus": 2, "target": 2}
        for step in {r["step"] for r in rows}:
            kinds = [order[r["kind"]] for r in rows if r["step"] == step]
            assert kinds == sorted(kinds) and kinds[-1] == 2
    assert totals["accepted"] == m["spec_decode_num_accepted_tokens"]
    assert totals["replacement"] + totals["bonus"] == m["spec_decode_num_drafts"]
    assert totals["accepted"] + totals["rejected"] == m["spec_decode_num_draft_tokens"]
    assert totals["bonus"] > 0 and totals["replacement"] > 0  # the repeating prompt gets full runs


def test_greedy_speculation_keeps_plain_tokens(draft_run):
    assert [o.outputs[0].token_ids for o in draft_run.outputs] == plain_tokens(PROMPTS, 20)


def test_stream_cut_where_a_stop_token_ends_the_request():
    """A stop token inside an accepted run: the engine drops what follows; so must the view."""
    # the draft model (not prompt lookup, whose accepted tokens repeat earlier ones) accepts
    # tokens that are new to the output, so one of them can be the stop token
    base = run_spec(make_llm, [REPEATING], DRAFT, k=4, max_tokens=24)
    rows = token_sources(base.trace, base.outputs[0])
    out_ids = base.outputs[0].outputs[0].token_ids
    # an accepted token, its first occurrence in the output, with more emitted after it in its step
    stop = next(r for r in rows if r["kind"] == "accepted" and r["token_id"] not in out_ids[:r["position"]]
                and any(o["step"] == r["step"] and o["position"] > r["position"] and o["kind"] != "rejected"
                        for o in rows))
    llm = make_llm(speculative_config={**DRAFT, "num_speculative_tokens": 4})
    out = llm.generate([REPEATING], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                   stop_token_ids=[stop["token_id"]]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out_ids[:stop["position"] + 1]
    step = next(s for e in llm.llm_engine.trace for s in e["scheduled"] if "emitted_token_ids" in s
                and stop["token_id"] in s["emitted_token_ids"][:-1])
    assert len(step["emitted_token_ids"]) > 1  # the engine emitted more than the request kept
    cut = token_sources(llm.llm_engine.trace, out)
    assert [r["token_id"] for r in cut if r["kind"] != "rejected"] == out.outputs[0].token_ids


def test_text_and_html_views(draft_run):
    tok = TOKENIZER
    rows = token_sources(draft_run.trace, draft_run.outputs[0])
    steps = step_rows(rows, tok)
    assert sum(s["accepted"] for s in steps) == sum(r["kind"] == "accepted" for r in rows)
    assert [s["step"] for s in steps] == sorted({r["step"] for r in rows})
    text = spec_tokens_text(rows, tok)
    assert "(replacement)" in text and "(target)" in text
    view = SpecTokens(rows, tok, prompt="x < y\n", title="demo")
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == "demo\n" + text and repr(view) == bundle["text/plain"]
    html = bundle["text/html"]
    assert "x &lt; y" in html and "line-through" in html  # escaped prompt; rejected drafts struck out
    assert html.count("<span") == len(rows) + len(KINDS) + 1  # every token, the legend, the prompt


def test_bad_inputs(draft_run):
    with pytest.raises(TypeError, match="RequestOutput"):
        token_sources(draft_run.trace, "r0")
    with pytest.raises(ValueError, match="not in the trace"):
        token_sources([], draft_run.outputs[0])
    with pytest.raises(ValueError, match="k"):
        run_spec(make_llm, PROMPTS, NGRAM, k=0)
    with pytest.raises(ValueError, match="enable_trace"):
        run_spec(lambda **kw: make_llm(enable_trace=False, **kw), PROMPTS, NGRAM, k=2)
    with pytest.raises(ValueError, match="'k' or 'temperature'"):
        sweep_figure([], x="steps")
    with pytest.raises(ValueError, match="same vocabulary"):
        first_token_counts(torch.ones(4) / 4, torch.ones(5) / 5, 10)
    with pytest.raises(ValueError, match="alpha"):
        speedup_model_rows(1.5, 0.1, [1])
    with pytest.raises(ValueError, match="method must be one of"):
        spec_widget(make_llm, PROMPTS, {"ngram": NGRAM}, method="medusa")


# -- acceptance per position, k and temperature --------------------------------------------------
def test_acceptance_by_position_is_the_engines_count(draft_run):
    rows = acceptance_by_position(draft_run.trace, 3)
    m = draft_run.metrics
    assert [r["accepted"] for r in rows] == [m[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(3)]
    assert rows[0]["proposed"] == rows[0]["reached"] == m["spec_decode_num_drafts"]
    assert sum(r["proposed"] for r in rows) == m["spec_decode_num_draft_tokens"]
    for a, b in zip(rows, rows[1:]):
        # the sampler reaches a draft only past an accepted one (a shorter proposal may end there)
        assert b["accepted"] <= b["reached"] <= a["accepted"]
    for r in rows:
        assert r["acceptance rate"] == pytest.approx(r["accepted"] / r["proposed"])
    fig = position_figure({"draft_model": rows})
    assert list(fig.data[0].y) == [round(r["acceptance rate"], 4) for r in rows]


def test_sweep_rows_follow_the_metrics():
    runs = acceptance_sweep(make_llm, PROMPTS[:1], {"ngram": NGRAM}, ks=[1, 3], temperatures=[0.0, 1.0],
                            max_tokens=16)
    assert set(runs) == {("ngram", k, t) for k in (1, 3) for t in (0.0, 1.0)}
    plain = plain_tokens(PROMPTS[:1], 16)
    for (name, k, t), run in runs.items():
        row = run.row()
        m = run.metrics
        assert (row["method"], row["k"], row["temperature"]) == (name, k, t)
        assert row["acceptance length"] == pytest.approx(1 + m["spec_decode_num_accepted_tokens"]
                                                         / m["spec_decode_num_drafts"])
        assert row["tokens"] == 16 and row["engine steps"] == len(run.trace)
        if t == 0.0:
            assert [o.outputs[0].token_ids for o in run.outputs] == plain
    again = run_spec(make_llm, PROMPTS[:1], NGRAM, k=3, temperature=1.0, max_tokens=16)
    assert again.outputs[0].outputs[0].token_ids == runs[("ngram", 3, 1.0)].outputs[0].outputs[0].token_ids  # seeded
    rows = [r.row() for r in runs.values()]
    fig = sweep_figure([r for r in rows if r["temperature"] == 0.0], x="k")
    assert [t.name for t in fig.data] == ["ngram", "k + 1 (all accepted)"]
    assert list(fig.data[1].y) == [2, 4]
    assert len(sweep_figure([r for r in rows if r["k"] == 3], x="temperature").data) == 1


def test_widget_runs_and_redraws():
    w = spec_widget(make_llm, PROMPTS[:1], {"ngram": NGRAM}, method="ngram", k=2, max_tokens=8)
    assert repr(w).startswith("[interactive widget: speculative decoding")
    out = w.children[1]
    first = out.outputs
    assert first[0]["data"]["text/plain"].startswith("ngram, k=2")
    w.children[0].children[1].value = 3  # the k slider
    assert out.outputs[0]["data"]["text/plain"].startswith("ngram, k=3")
    assert any(o.get("output_type") == "stream" and "acceptance length" in o["text"] for o in out.outputs)


# -- the output distribution --------------------------------------------------------------------------
def dist(seed: int, n: int = 12) -> torch.Tensor:
    p = torch.rand(n, generator=torch.Generator().manual_seed(seed)) ** 2
    return p / p.sum()


def test_rejection_sampler_gives_p_and_always_accept_gives_q():
    p, q = dist(1), dist(2)
    bins = top_bins(p, q, top=5)
    counts, accepted = first_token_counts(p, q, 4000, seed=0)
    assert int(counts.sum()) == 4000
    assert chi_square(counts, p, bins)[2] > 1e-3
    # acceptance probability of a draft drawn from q is sum(min(p, q)); 4000 draws, within 4 sigma
    alpha = float(torch.minimum(p, q).sum())
    assert abs(accepted / 4000 - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / 4000)
    broken, all_accepted = first_token_counts(p, q, 4000, seed=0, sampler=always_accept)
    assert all_accepted == 4000
    assert chi_square(broken, p, bins)[2] < 1e-6  # the negative control fails the same test
    assert chi_square(broken, q, bins)[2] > 1e-3  # because it reproduces the draft instead


def test_chi_square_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    p = dist(3)
    counts = torch.multinomial(dist(4), 500, replacement=True, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(counts, minlength=12)
    bins = [0, 3, 5, 7]
    stat, dof, pvalue = chi_square(counts, p, bins)
    observed = [float(counts[b]) for b in bins] + [float(counts.sum()) - sum(float(counts[b]) for b in bins)]
    rest = 1 - sum(float(p[b]) for b in bins)
    expected = [float(p[b]) * 500 for b in bins] + [rest * 500]
    ref = scipy_stats.chisquare(observed, expected)
    assert dof == 4
    assert stat == pytest.approx(ref.statistic) and pvalue == pytest.approx(ref.pvalue, rel=1e-6)
    impossible = torch.tensor([0.5, 0.5, 0.0])
    assert chi_square(torch.tensor([3, 3, 1]), impossible, [0, 1, 2])[2] == 0.0


def test_distribution_rows_and_figure():
    p, q = dist(1), dist(2)
    counts, _ = first_token_counts(p, q, 500, seed=0)
    bins = top_bins(p, q, top=3)
    rows = distribution_rows(p, q, {"speculative": counts}, bins)
    assert len(rows) == len(bins) + 1 and rows[-1]["token_id"] is None
    for col in ("p (target)", "q (draft)", "speculative"):
        assert sum(r[col] for r in rows) == pytest.approx(1.0)
    assert [r["p (target)"] for r in rows[:-1]] == sorted((r["p (target)"] for r in rows[:-1]), reverse=True)
    assert [t.name for t in distribution_figure(rows).data] == ["p (target)", "q (draft)", "speculative"]


# -- speedup -------------------------------------------------------------------------------------------
def test_speedup_model():
    rows = speedup_model_rows(0.8, 0.05, [1, 2, 4])
    assert [r["tokens per target forward"] for r in rows] == pytest.approx([1.8, 2.44, 3.3616])
    assert [r["predicted speedup"] for r in rows] == pytest.approx([predicted_speedup(0.8, k, 0.05) for k in (1, 2, 4)])
    assert speedup_model_rows(1.0, 0.0, [3])[0]["predicted speedup"] == 4.0
    assert len(speedup_model_figure([0.5, 0.9], 0.1, [1, 2, 3]).data) == 2
    w = speedup_model_widget(alpha=0.6, c=0.1, max_k=4)
    assert "best k" in w.children[1].outputs[1]["text"]


def test_speedup_rows_from_the_benchmark():
    stream = TOKENIZER("def f(x):\n    return x + 1\n" * 20, add_special_tokens=False)["input_ids"]
    requests = make_requests(stream, 2, (24, 32), (8, 8), seed=0)
    result = bench_spec(make_llm, requests, ["ngram"], [2], batch1=1, progress=False)
    rows = speedup_rows(result)
    assert [(r["method"], r["k"]) for r in rows] == [("plain", "-"), ("ngram", 2)]
    assert rows[0]["speedup"] == 1.0 and rows[0]["c"] is None
    assert rows[1]["same tokens"] == "1/1"
    run = result["runs"]["ngram:2"]
    assert rows[1]["acceptance length"] == run["batch1"]["mean_acceptance_length"]
    # the measured verification cost in place of Leviathan et al.'s 1
    alpha, c = run["alpha"], rows[1]["c"]
    assert rows[1]["predicted, verify = 1"] == pytest.approx(predicted_speedup(alpha, 2, c))
    assert rows[1]["predicted, measured verify"] == pytest.approx(predicted_speedup(alpha, 2, c, rows[1]["verify"]))
    fig = speedup_figure(result)
    assert [t.name for t in fig.data[:3]] == ["measured", "predicted, verify = 1", "predicted, measured verify"]
    assert list(fig.data[3].x) == ["plain", "ngram k=2"]


def test_recorded_trees_and_their_accepted_paths_spell_the_output():
    """Every tree the EAGLE-2 proposer drafted is recorded; under greedy decoding the accepted
    nodes counted from the output add up to the engine's own accepted-token counter."""
    from llmopt.viz.spec_tree import accepted_nodes, recording_trees, tree_rows, tree_summary, tree_text

    tok = AutoTokenizer.from_pretrained(model_path("tiny"))
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    llm = make_llm(speculative_config={"method": "eagle", "model": "tiny-eagle", "num_speculative_tokens": 3,
                                       "tree": {"top_k": 3, "total_tokens": 8}})
    with recording_trees(llm) as trees:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert trees and all(1 <= len(t.tree) <= 8 and max(t.tree.depths) <= 3 for t in trees)
    outputs = {out.request_id: ids}
    total = 0
    for t in trees:
        path = accepted_nodes(t, ids)
        assert [t.tree.tokens[n] for n in path] == ids[t.made:t.made + len(path)]
        assert [t.tree.depths[n] for n in path] == list(range(1, len(path) + 1))
        total += len(path)
    assert total == int(llm.get_metrics()["spec_decode_num_accepted_tokens"])
    assert sum(r["accepted"] for r in tree_rows(trees, outputs)) == total
    text = tree_text(trees[0].tree, tok, accepted_nodes(trees[0], ids))
    assert len(text.splitlines()) == len(trees[0].tree) and text.count("*") == len(accepted_nodes(trees[0], ids))
    assert f"{len(trees)} trees" in tree_summary(trees, outputs)
    with pytest.raises(ValueError, match="tree proposer"):
        with recording_trees(make_llm()):
            pass
    assert "propose" not in vars(llm.llm_engine.proposer)  # the proposer is itself again


def test_tree_widget_runs_and_redraws():
    """The EAGLE-2 knobs' widget: a live run per setting, the accepted path marked in the tree
    drawn, the table's settings following the sliders, greedy text equal to plain decoding's."""
    from llmopt.viz.spec_tree import tree_widget

    made = []

    def make(sc):
        made.append(sc)
        return make_llm(speculative_config=sc)

    w = tree_widget(make, "def fibonacci(n):\n    if n < 2:\n", head="tiny-eagle", top_k=2, depth=3,
                    total_tokens=6, max_tokens=16)
    assert repr(w).startswith("[interactive widget: EAGLE-2 tree")
    assert made[0] is None and made[1]["tree"] == {"top_k": 2, "total_tokens": 6}
    table, tree = (o["text"] for o in w.children[1].outputs)
    assert "acceptance length" in table and table.splitlines()[2].split()[:3] == ["2", "3", "6"]
    assert table.splitlines()[2].split()[-1] == "True"  # same text as plain
    assert "*" in tree
    w.children[0].children[0].value = 3  # top_k
    assert made[-1]["tree"]["top_k"] == 3 and len(made) == 3  # plain ran once
