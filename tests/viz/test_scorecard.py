"""The scorecard's verdicts, and the guard that keeps a GPU report on broken weights from deciding a claim."""

import json
from pathlib import Path

import pytest

from llmopt.package_data import committed_result
from llmopt.viz.scorecard import FAILS, HOLDS, NEEDS_GPU, Scorecard, gpu_quality, gpu_quant_speed, gpu_report


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


ROWS = [{"name": "bf16", "label": "bf16 weights and activations", "activations": "bfloat16",
         "perplexity": 9.55, "cpu_perplexity": None, "vs_cpu": None, "vs_cpu_fp32": 0.0004, "vs_bf16": 0.0,
         "greedy_vs_bf16": {"identical": 16, "of": 16, "prefix_share": 1.0},
         "kv_blocks": 53951, "kv_blocks_vs_bf16": 1.0},
        {"name": "fp8-kv", "label": "FP8 e4m3 KV cache, calibrated scales", "activations": "bfloat16",
         "perplexity": 9.62, "cpu_perplexity": 9.616, "vs_cpu": 0.0004, "vs_cpu_fp32": 0.008, "vs_bf16": 0.007,
         "greedy_vs_bf16": {"identical": 5, "of": 16, "prefix_share": 0.4},
         "kv_blocks": 107538, "kv_blocks_vs_bf16": 1.99}]


SPEED = [{"model": "SmolLM2", "sequences": 1, "weights": "bf16", "weight_bytes": 269_000_000,
          "decode_tokens_per_s": 900.0, "vs_bf16": 1.0},
         {"model": "SmolLM2", "sequences": 1, "weights": "W4A16 (RTN g128)", "weight_bytes": 90_000_000,
          "decode_tokens_per_s": 950.0, "vs_bf16": 950 / 900}]


def _report(tmp_path, dry_run=False, sanity="ok", quality="ok", speed=None) -> Path:
    """A report in benchmarks/gpu_check.py's JSON format; a status of None leaves that section out."""
    sections = [{"name": "env", "status": "ok", "numbers": {"load_average_1min": 0.4}}]
    if sanity is not None:
        sections.append({"name": "smollm2-sanity", "status": sanity, "numbers": {}, "checks": [
            {"name": "greedy tokens vs the CPU", "ok": sanity == "ok", "detail": "16 of 16 identical"}]})
    if quality is not None:
        sections.append({"name": "smollm2-quality", "status": quality, "checks": [], "numbers": {
            "cpu_fp32_perplexity": 9.546, "protocol": "perplexity protocol", "rows": ROWS}})
    if speed is not None:
        sections.append({"name": "quant-speed", "status": speed, "checks": [], "numbers": {"rows": SPEED}})
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"device_name": "NVIDIA H200", "dry_run": dry_run,
                                "command": "python benchmarks/gpu_check.py", "sections": sections}))
    return path


def test_a_gpu_report_whose_smollm2_passed_counts_and_its_quality_rows_with_it(tmp_path):
    report, why = gpu_report(_report(tmp_path))
    assert report is not None and report["device_name"] == "NVIDIA H200" and "NVIDIA H200" in why
    rows, why = gpu_quality(_report(tmp_path))
    assert rows == ROWS
    assert "measured on NVIDIA H200 by benchmarks/gpu_check.py" in why and "CPU's same configuration" in why


@pytest.mark.parametrize("report, words", [
    (dict(dry_run=True), "dry run"),
    (dict(sanity="failed"), "failed (greedy tokens vs the CPU: 16 of 16 identical)"),
    (dict(sanity="timeout"), "ran out of time"),
])
def test_a_dry_run_or_a_smollm2_that_did_not_pass_decides_nothing(tmp_path, report, words):
    path = _report(tmp_path, **report)
    for counted, why in (gpu_report(path), gpu_quality(path)):
        assert counted is None and words in why


def test_the_quality_rows_count_only_where_their_own_section_passed(tmp_path):
    assert gpu_report(_report(tmp_path, quality="failed"))[0] is not None   # its timings still count
    for quality, words in (("failed", "quality section failed"), ("not run", "did not run"),
                           (None, "no smollm2-quality")):
        rows, why = gpu_quality(_report(tmp_path, quality=quality))
        assert rows is None and words in why


def test_a_report_from_before_the_sanity_check_does_not_count_and_says_why(tmp_path):
    path = _report(tmp_path, sanity=None, quality=None)
    report = json.loads(path.read_text())
    old = {"name": "smollm2-fp8", "status": "ok", "numbers": {"bf16": {"perplexity": 896_246.16}}}
    report["sections"].append(old)
    path.write_text(json.dumps(report))
    for counted, why in (gpu_report(path), gpu_quality(path)):
        assert counted is None and "before the GPU's SmolLM2 was checked" in why and "perplexity 896,246" in why
    counted, why = gpu_report(_report(tmp_path, sanity=None, quality=None))   # no perplexity to quote
    assert counted is None and "lossy rebuild" in why and "perplexity" not in why


def test_the_committed_report_counts_only_if_it_passed_the_sanity_check():
    report, why = gpu_report()
    sections = {s["name"]: s for s in report["sections"]} if report else {}
    assert report is None or sections["smollm2-sanity"]["status"] == "ok", why


def test_no_report_is_no_figure(tmp_path):
    for counted, why in (gpu_report(tmp_path / "absent.json"), gpu_quality(tmp_path / "absent.json")):
        assert counted is None and "no GPU report" in why


def test_the_h200_report_of_2026_12_04_does_not_count_its_smollm2_was_a_lossy_rebuild():
    report, why = gpu_report(committed_result("gpu_check_2026-12-04.json"))
    assert report is None and "lossy rebuild (perplexity 896,246)" in why


def test_the_quantized_speed_rows_count_where_their_section_passed(tmp_path):
    rows, why = gpu_quant_speed(_report(tmp_path, speed="ok"))
    assert rows == SPEED and "measured on NVIDIA H200" in why
    for speed, words in (("failed", "speed section failed"), (None, "no quant-speed")):
        rows, why = gpu_quant_speed(_report(tmp_path, speed=speed))
        assert rows is None and words in why
    rows, why = gpu_quant_speed(_report(tmp_path, dry_run=True, speed="ok"))
    assert rows is None and "dry run" in why


def test_the_lessons_speed_table_names_the_device_or_says_why_not(tmp_path):
    from llmopt.viz.scorecard import gpu_speed_table

    text = gpu_speed_table("W4A16", _report(tmp_path, speed="ok"))
    assert "W4A16 (RTN g128)" in text and "1.06x" in text and "NVIDIA H200" in text
    assert "W4A16" not in gpu_speed_table("FP8", _report(tmp_path, speed="ok"))  # bf16 beside FP8 rows only
    assert gpu_speed_table("W4A16", tmp_path / "absent.json").startswith("no GPU speed table counts yet")


def test_a_claim_scored_by_its_tests(capsys):
    from llmopt.viz.scorecard import claim_verdict

    assert claim_verdict([(0.9, ">=", 0.9), (0.01, "<=", 0.01)]) == HOLDS
    assert claim_verdict([(40e9, ">", 40e9)]) == claim_verdict([(0.01, "<", 0.01)]) == FAILS
    assert claim_verdict([(None, "<", 0.2), (6.0, ">=", 5)]) == NEEDS_GPU
    assert claim_verdict([(None, "<", 0.2), (3.0, ">=", 5)]) == FAILS            # refuted whatever the GPU says
    assert claim_verdict([(1.4, ">=", 2)], refutable=False) == NEEDS_GPU         # a GPU's claim, short on a CPU
    card = Scorecard()
    card.score("a", [(2.5, ">=", 2), (1.1, "<=", 1.5)], "x2.5, x1.1", "why", refutable=False)
    assert card.rows[-1].verdict == HOLDS and card.rows[-1].tests == [(2.5, ">=", 2.0), (1.1, "<=", 1.5)]
    with pytest.raises(TypeError, match="op one of"):
        card.score("b", [(1.0, "=>", 2)], "x1", "why")
