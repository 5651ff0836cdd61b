"""The scorecard's verdicts, and the guard that keeps a GPU report on broken weights from deciding a claim."""

import json

import pytest

from llmopt.package_data import committed_result
from llmopt.viz.scorecard import FAILS, HOLDS, NEEDS_GPU, Scorecard, gpu_report


def test_a_verdict_is_holds_fails_or_needs_a_gpu_and_a_rerun_replaces_its_row(capsys):
    card = Scorecard()
    card.score("a", True, "x1.5", "why")
    assert card.rows[-1].verdict == HOLDS
    card.score("b", False, "x0.9", "why", source="table t")
    card.score("c", None, "-", "a GPU claim")
    assert [r.verdict for r in card.rows] == [HOLDS, FAILS, NEEDS_GPU]
    card.score("a", False, "x0.8", "measured again")
    assert [r["claim"] for r in card.table()] == ["b", "c", "a"]
    assert card.counts() == {HOLDS: 0, FAILS: 2, NEEDS_GPU: 1}
    out = capsys.readouterr().out
    assert "a: HOLDS. x1.5 (why). Source: measured here (" in out and "Source: table t." in out


@pytest.mark.parametrize("bad", [dict(holds=1), dict(holds="yes"), dict(figure=""), dict(reason="  ")])
def test_score_refuses_what_is_not_a_verdict(bad):
    kwargs = dict(claim="a", holds=True, figure="x1", reason="why") | bad
    with pytest.raises((TypeError, ValueError)):
        Scorecard().score(**kwargs)


def _report(tmp_path, perplexity: float, greedy: str = "ok"):
    report = json.loads(committed_result("gpu_check.json").read_text())
    for section in report["sections"]:
        if section["name"] == "smollm2-greedy":
            section["status"] = greedy
        if section["name"] == "smollm2-fp8":
            section["numbers"]["bf16"]["perplexity"] = perplexity
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    return path


def test_a_gpu_report_counts_only_where_its_model_is_the_model(tmp_path):
    ok, why = gpu_report(_report(tmp_path, 10.0), cpu_fp32_perplexity=9.5)
    assert ok is not None and "within" in why
    broken, why = gpu_report(_report(tmp_path, 896_246.0), cpu_fp32_perplexity=9.5)
    assert broken is None and "not SmolLM2's" in why
    failed, why = gpu_report(_report(tmp_path, 10.0, greedy="failed"), cpu_fp32_perplexity=9.5)
    assert failed is None and "greedy" in why
    assert gpu_report(tmp_path / "absent.json")[0] is None
