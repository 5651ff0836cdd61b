"""benchmarks/gpu_check.py cannot rot while no GPU is at hand: its dry run (the same sections
and code paths, on the CPU through Triton's interpreter, tiny shapes, no timings) completes
with every section ok, and writes the JSON and markdown reports the GPU run would; and its
checks can fail: with one weight matrix corrupted after the references were computed, the
sanity checks fail and no section on that model reports ok."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_passes_every_section(tmp_path):
    md, js = tmp_path / "gpu_check.md", tmp_path / "gpu_check.json"
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run",
                        "--out", str(md), "--json", str(js)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert js.is_file(), f"no report written (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    report = json.loads(js.read_text())
    bad = {s["name"]: (s["status"], s["error"], [c for c in s["checks"] if not c["ok"]])
           for s in report["sections"] if s["status"] != "ok"}
    assert not bad, f"sections not ok: {bad}\n{r.stdout[-3000:]}"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert report["dry_run"] and report["total_budget_s"] <= 440
    names = [s["name"] for s in report["sections"]]
    assert names[:3] == ["env", "cuda-tests", "kernels"] and names[-3:] == ["decode-speed", "speculation",
                                                                            "quant-speed"]
    assert set(report["summary"]) == {"smollm2_bf16_batch1_tok_s", "dense8b_bf16_batch1_bw_share",
                                      "prefill8b_tflops_share", "ngram_edit_speedup_batch1",
                                      "w4a16_vs_bf16_batch1_8b", "fp8w_vs_bf16_batch1_8b",
                                      "fp8kv_attention_speedup_8b_64x2048"}
    # kernel timings are not taken in the dry run (Run.timed): their figure stays empty there
    summary = dict(report["summary"])
    assert summary.pop("fp8kv_attention_speedup_8b_64x2048")["value"] is None
    assert all(f["value"] is not None and f["value"] > 0 for f in summary.values())
    quality = next(s for s in report["sections"] if s["name"] == "smollm2-quality")["numbers"]
    assert [r["name"] for r in quality["rows"]] == ["bf16", "fp16", "fp8-kv", "fp8-w", "rtn4", "gptq4", "awq4"]
    assert all(abs(r["vs_cpu"]) <= 0.01 for r in quality["rows"] if r["cpu_perplexity"] is not None)
    assert all(s["checks"] for s in report["sections"]), "every section checks something"
    text = md.read_text()
    assert all(f"| {n} | ok |" in text for n in names)


def test_gpu_check_refuses_to_time_a_cpu_as_a_gpu():
    """Without --dry-run on a machine without CUDA it says what to run instead, and stops."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--dry-run" in r.stderr


def test_gpu_check_names_unknown_sections():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--only",
                        "kernelz"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "kernelz" in r.stderr and "kernels" in r.stderr


def test_a_planted_fault_fails_the_sanity_checks_and_every_section_on_that_model(tmp_path):
    """The check that passed a garbage SmolLM2 compared two systems on the same broken weights. The
    references are absolute: with one weight matrix corrupted after they were computed, float32
    greedy tokens and perplexity leave the CPU's, and every section that runs the model fails."""
    md, js = tmp_path / "gpu_check.md", tmp_path / "gpu_check.json"
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--plant-fault",
                        "--only", "smollm2-quality", "cuda-graphs", "smollm2-throughput", "decode-speed",
                        "speculation", "quant-speed",
                        "--out", str(md), "--json", str(js)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert js.is_file(), f"no report written (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    sections = {s["name"]: s for s in json.loads(js.read_text())["sections"]}
    sanity = sections["smollm2-sanity"]  # run although --only left it out: it gates the others
    failed = {c["name"] for c in sanity["checks"] if not c["ok"]}
    assert sanity["status"] == "failed"
    assert any(n.startswith("float32 greedy tokens") for n in failed), sanity["checks"]
    assert any(n.startswith("float32 perplexity") for n in failed), sanity["checks"]
    assert "the model file is the CPU's (sha256)" in failed
    for name in ("smollm2-quality", "cuda-graphs", "smollm2-throughput", "decode-speed", "speculation",
                 "quant-speed"):
        assert sections[name]["status"] == "failed", (name, sections[name]["checks"])
    assert not any(s["status"] == "ok" for s in sections.values())
    assert "| smollm2-sanity | failed |" in md.read_text()
    assert all(f["value"] is None for f in json.loads(js.read_text())["summary"].values())


def test_plant_fault_needs_the_dry_run():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--plant-fault"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--dry-run" in r.stderr
