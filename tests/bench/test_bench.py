"""The benchmarks at toy sizes: every workload runs, prints a well-formed table, and the
engine's greedy tokens equal the one-request-at-a-time loop's. No timing is asserted:
speed belongs in benchmarks/results, measured side by side."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from llmopt.bench import run_workload
from llmopt.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-requests", "4", "--prompt-len", "24", "48", "--output-len", "3", "9",
         "--num-kv-blocks", "256", "--threads", "1", "--no-progress"]


def bench_args(workload, *extra):
    return build_parser().parse_args(["bench", "--workload", workload, *SMALL, *extra])


def tables(text):
    """Markdown tables in text -> list of (header cells, rows of cells)."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            found.append((block[0], block[2:], block[1]))
            block = []
    for head, rows, sep in found:
        assert all(re.fullmatch("-{3,}", c) for c in sep) and len(sep) == len(head)
        assert rows and all(len(r) == len(head) for r in rows)
    return [(head, rows) for head, rows, _ in found]


def check_header(text, workload):
    first = text.splitlines()[0]
    assert first.startswith("model `tiny`") and "threads" in first and "float32" in first
    assert f"command: `llmopt bench --workload {workload} " in first


@pytest.fixture(scope="module")
def offline():
    return run_workload(bench_args("offline", "--batch-size", "2"))


def test_offline_table_and_greedy_agreement(offline):
    text, raw = offline
    check_header(text, "offline")
    [(head, rows)] = tables(text)
    assert head[:2] == ["system", "generated tokens/s"] and len(rows) == 3
    assert rows[0][0].startswith("HF transformers `generate`, static batches of 2")
    assert rows[1][0].startswith("llmopt, one request at a time") and rows[2][0].startswith("llmopt engine")
    sy = raw["systems"]
    engine, one, hf = sy["engine"]["tokens"], sy["one_at_a_time"]["tokens"], sy["hf_static_2"]["tokens"]
    assert engine == one and sy["one_at_a_time"]["identical_to_engine"] == 4 and rows[1][-1] == "4/4"
    assert [len(t) for t in engine] == raw["max_tokens"] and [len(t) for t in hf] == raw["max_tokens"]
    assert sy["hf_static_2"]["tokens_computed"] >= raw["tokens_asked"]  # static batches waste
    assert "engine / HF static batching" in text


def test_kv_memory_shares():
    text, raw = run_workload(bench_args("kv-memory"))
    check_header(text, "kv-memory")
    [(head, rows)] = tables(text)
    assert len(rows) == 3 and rows[0][0].startswith("paged")
    s = raw["schemes"]
    for scheme in s.values():
        assert 0 < scheme["mean_share_over_steps"] <= 1 and 0 < scheme["weighted_share"] <= 1
    # every request reserving max_model_len can only waste more than blocks do
    assert s["paged"]["weighted_share"] > s["contiguous_max_model_len"]["weighted_share"]


def test_prefix_caching_hits_and_keeps_tokens():
    # a small step budget, so later requests find the prefix the first ones cached
    text, raw = run_workload(bench_args("prefix", "--prefix-len", "32", "--max-num-batched-tokens", "64"))
    check_header(text, "prefix")
    [(head, rows)] = tables(text)
    assert [r[0] for r in rows] == ["prefix caching off", "prefix caching on"]
    assert raw["runs"]["off"]["hit_rate"] == 0 and raw["runs"]["on"]["hit_rate"] > 0
    assert raw["same_tokens"] == raw["num_requests"]


def test_chunked_prefill_table():
    text, raw = run_workload(bench_args("chunked", "--num-requests", "2", "--output-len", "12", "12",
                                        "--num-long", "1", "--long-len", "100", "--chunk-budget", "32"))
    check_header(text, "chunked")
    [(head, rows)] = tables(text)
    assert len(rows) == 2 and "gap p90 (ms)" in head
    assert raw["runs"]["on"]["gaps"] and raw["runs"]["off"]["gaps"]
    assert raw["runs"]["on"]["steps"] > raw["runs"]["off"]["steps"]  # the prompt took several steps
    assert raw["same_tokens"] == 3


def test_cli_kv_cache_workload_still_works(capsys):
    assert main(["bench", "--workload", "kv-cache", "--lengths", "8", "--threads", "1", "--no-progress"]) == 0
    [(head, rows)] = tables(capsys.readouterr().out)
    assert head[0] == "tokens generated" and rows[0][-1] == "yes"


def test_benchmark_script_writes_markdown_and_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "benchmarks" / "engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--workloads", "kv-memory", "--out-dir", str(tmp_path), *SMALL]) == 0
    md = (tmp_path / "engine.md").read_text()
    assert "python benchmarks/engine.py --workloads kv-memory" in md
    assert len(tables(md)) == 1
    raw = json.loads((tmp_path / "engine.json").read_text())
    assert raw["kv-memory"]["schemes"]["paged"]["share_per_step"]


def test_spec_workload_side_by_side():
    text, raw = run_workload(bench_args("spec", "--spec-methods", "ngram", "draft_model", "--spec-k", "2",
                                        "--num-requests", "2", "--spec-batch1", "1",
                                        "--output-len", "12", "12"))
    check_header(text, "spec")
    assert set(raw["runs"]) == {"plain:0", "ngram:2", "draft_model:2"}
    assert raw["same_tokens"] == {"plain:0": 1, "ngram:2": 1, "draft_model:2": 1}  # greedy = plain
    d = raw["runs"]["draft_model:2"]["batch1"]
    assert 1 <= d["mean_acceptance_length"] <= 3 and 0 <= d["acceptance_rate"] <= 1
    # fewer target forwards than tokens once anything is accepted; never more than one per token
    assert d["forwards_per_token"] <= 1.0
    assert "| draft_model | 2 |" in text and "predicted (v = 1)" in text


def test_leviathan_formula():
    from llmopt.bench.spec import alpha_from_length, expected_tokens_per_step, predicted_speedup

    assert expected_tokens_per_step(0.0, 4) == 1.0 and expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert alpha_from_length(1.75, 2) == pytest.approx(0.5, abs=1e-6)
    assert predicted_speedup(0.5, 2, c=0.25) == pytest.approx(1.75 / 1.5)
    assert predicted_speedup(0.5, 2, c=0.0, verify=1.75) == pytest.approx(1.0)


def test_smollm2_benchmark_script_runs_side_by_side(tmp_path):
    """benchmarks/smollm2.py at toy sizes: both systems run the same requests, the greedy
    tokens agree in float32, and the table carries the ratio and where the time goes."""
    spec = importlib.util.spec_from_file_location("bench_smollm2", ROOT / "benchmarks" / "smollm2.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--dtypes", "float32", "--num-requests", "3", "--prompt-len", "8", "24",
                        "--output-len", "2", "6", "--reps", "1", "--profile-steps", "1",
                        "--skip-one-at-a-time", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "smollm2.md").read_text()
    assert "engine / transformers' static batching" in md and len(tables(md)) == 2
    raw = json.loads((tmp_path / "smollm2.json").read_text())["float32"]
    assert raw["hf_identical_to_engine"] == 3 and raw["engine_num_preemptions"] == 0
    assert raw["phases"]["decode_steps"] > 0 and raw["profile"]["ops"]


def test_bandwidth_is_measured_as_stream_does():
    from llmopt.bench.common import llc_bytes, machine
    from llmopt.bench.roofline import measure_bandwidth, stream_megabytes

    assert stream_megabytes(300 * 2**20) == 3000 and stream_megabytes(8 * 2**20) == 512   # >= 10x the LLC
    llc = llc_bytes()
    assert llc is None or (llc > 0 and f"{llc / 2**20:g} MiB LLC" in machine())
    rows = measure_bandwidth((1,), megabytes=16, repeats=1)
    kernels = ("read", "copy", "scale", "add", "triad")
    assert [r["threads"] for r in rows] == [1] and rows[0]["array_mb"] == 16
    assert all(rows[0][k] > 0 for k in kernels) and rows[0]["best"] == max(rows[0][k] for k in kernels)
