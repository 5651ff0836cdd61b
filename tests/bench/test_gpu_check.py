"""benchmarks/gpu_check.py cannot rot while no GPU is at hand: its dry run (the same sections
and code paths, on the CPU through Triton's interpreter, tiny shapes, no timings) completes
with every section ok, and writes the JSON and markdown reports the GPU run would."""

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
    assert report["dry_run"] and report["total_budget_s"] <= 480
    names = [s["name"] for s in report["sections"]]
    assert names[:3] == ["env", "cuda-tests", "kernels"] and "smollm2-throughput" in names
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


def test_carry_round_trip_is_the_quantized_model(tmp_path):
    """The compact form rebuilds, to the bit, into weights within half a step of the originals
    (norms exactly), with the folder's small files as they were."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from smollm2_carry import rebuild, write_carry

    g = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g),
               "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48, generator=g) * 0.02,
               "model.layers.0.input_layernorm.weight": torch.rand(32, generator=g)}
    weights["model.layers.0.mlp.down_proj.weight"][3, 5] = 5.0  # an outlier
    files = {"config.json": b'{"model_type": "llama"}\n', "tokenizer.json": b"{}"}
    manifest = write_carry(weights, files, tmp_path / "carry", step=1.0, step_embedding=0.5)
    assert manifest["bytes"] < sum(w.numel() * 4 for w in weights.values())
    out = rebuild(tmp_path / "carry", tmp_path / "model")
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(weights)
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], weights["model.layers.0.input_layernorm.weight"])
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
        w = weights[name]
        step = (w.pow(2).mean(1, keepdim=True).sqrt() * (0.5 if "embed" in name else 1.0))
        assert torch.all((got[name] - w).abs() <= step / 2 + 1e-6), name
    assert (out / "tokenizer.json").read_bytes() == b"{}" and (out / "config.json").is_file()
    with pytest.raises(FileNotFoundError, match="--prepare"):
        rebuild(tmp_path / "nothing", tmp_path / "model2")
