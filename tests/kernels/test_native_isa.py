"""The C++ kernels built for this CPU's own instructions, tested even when this process is pinned.

With `--nbval` (the CI command) the repository's conftest.py gives this process the lessons'
environment, ATEN_CPU_CAPABILITY=avx2, so that the notebooks' kernels compute the stored bits; the
C++ kernels then build for AVX2 alone (llmopt/kernels/cpu/__init__.py), and their AVX-512 paths,
the ones the engine runs on such a CPU (VNNI block tiles, GGUF panels, the AVX-512 attention
kernel), would go untested. This test runs those kernels' tests again in a fresh process without
the pin, built for the host (a second build, cached like the first)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmopt.kernels import cpu

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.environ.get("ATEN_CPU_CAPABILITY"), reason="this process already builds for the host")
@pytest.mark.skipif("avx512f" not in cpu.cpu_flags().split(), reason="no AVX-512 here: the pinned build is the host's")
def test_kernels_built_for_this_cpu_equal_their_references():
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    selection = ("panels or int8 or blocks or float32_activations or decode_batch or mixed_batch or draft_tree or fp8_pool"
                 " or long_prompts")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
                          "tests/kernels/test_cpu_kernels.py", "tests/kernels/test_dense_kernels.py", "-k", selection],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    if "avx512_vnni" in cpu.cpu_flags().split():   # the panels ran, not skipped as in the pinned build
        assert "no AVX512_VNNI in this build" not in run.stdout, tail
