"""The compiled step (one C++ call for every layer) gives the eager path's tokens.

`enforce_eager=True` is the reference. Both run the same engine; only the steps' forward
differs (prompts, their chunks and decodes alike), so in float32 greedy tokens must be equal, with chunked prefill, prefix
caching and preemption exercised on the way, on tiny and on SmolLM2 (dense and with the GGUF
file's blocks kept).
"""

import os
import subprocess
import sys

import pytest

from llmopt import LLM, SamplingParams
from llmopt.kernels import cpu
from llmopt.worker.model_runner import StepBackend

needs_kernels = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels cannot be built here")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "# sort a list of numbers\n" * 6, "x = [", "for i in range(10):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_kernels
@pytest.mark.parametrize("knobs", [
    {},                                                    # plain batch
    {"max_num_batched_tokens": 24},                        # prompts in chunks, decodes beside them
    {"num_kv_blocks": 12, "max_num_seqs": 6},              # too few blocks: preemption and recompute
    {"block_size": 8, "enable_prefix_caching": True},      # shared prefixes served from the cache
    {"kv_cache_dtype": "bfloat16"},                         # a float32 model's KV in 16 bits
])
def test_tiny_compiled_equals_eager(knobs):
    settings = dict(model="tiny", device="cpu", dtype="float32", seed=0, **knobs)
    compiled, eager = LLM(**settings), LLM(**settings, enforce_eager=True)
    assert compiled.llm_engine.decode_path == "compiled"
    assert eager.llm_engine.decode_path == "eager (enforce_eager=True)"
    assert tokens(compiled) == tokens(eager)
    if knobs.get("enable_prefix_caching"):  # a later request reads the blocks the first call cached
        later = [PROMPTS[3] + "def f():", PROMPTS[2] + " pass"]
        assert tokens(compiled, later) == tokens(eager, later)
    if "num_kv_blocks" in knobs:
        assert compiled.get_metrics()["num_preemptions"] > 0
    if knobs.get("enable_prefix_caching"):
        assert compiled.get_metrics()["prefix_cache_hits"] > 0


@needs_kernels
def test_every_step_really_takes_the_compiled_path(monkeypatch):
    llm = LLM(model="tiny", device="cpu", dtype="float32")
    calls = []
    real = llm.llm_engine.runner.backend.forward
    monkeypatch.setattr(llm.llm_engine.runner.backend, "forward", lambda *a: calls.append(1) or real(*a))
    tokens(llm, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(calls) == 5  # the prompts' step and the 4 decode steps after it


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_smollm2_compiled_equals_eager(quantization):
    settings = dict(model="smollm2", device="cpu", dtype="float32", seed=0, quantization=quantization,
                    max_num_batched_tokens=64)
    compiled, eager = LLM(**settings), LLM(**settings, enforce_eager=True)
    assert compiled.llm_engine.decode_path == "compiled"
    if quantization == "gguf":
        # The block kernels round each row of activations to int8 (llama.cpp's arithmetic), so a
        # last-bit difference in attention's float32 sums (torch's, which enforce_eager reads the
        # pool with, against the C++ kernel's) can round a value the other way and part the tokens.
        # Over the same attention kernel the eager layers and the fused step must agree exactly;
        # torch's attention against the kernel's is tests/worker/test_paged_cache.py's.
        eager.llm_engine.kv_cache.use_attention("cpu")
    prompts = ["The capital of France is", "def add(a, b):", "Three colours of the rainbow are"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert tokens(compiled, prompts, params) == tokens(eager, prompts, params)


def test_what_stays_eager_says_why():
    fp8 = LLM(model="tiny", device="cpu", dtype="float32", kv_cache_dtype="fp8")
    assert fp8.llm_engine.decode_path.startswith("eager (the KV pool is not a paged pool in the model's dtype")
    int8 = LLM(model="tiny", device="cpu", dtype="bfloat16", quantization="int8")
    assert int8.llm_engine.decode_path.startswith("eager (")


def test_without_a_compiler_the_eager_path_runs_with_a_notice(tmp_path):
    """No C++ toolchain (CXX=/bin/false and an empty kernel cache): one notice, the same tokens."""
    code = ("import warnings; warnings.simplefilter('always');"
            "from llmopt import LLM, SamplingParams;"
            "llm = LLM(model='tiny', device='cpu', dtype='float32');"
            "print(llm.llm_engine.decode_path);"
            "o = llm.generate(['def fibonacci(n):'], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),"
            " use_tqdm=False); print(list(o[0].outputs[0].token_ids))")
    env = {**os.environ, "CXX": "/bin/false", "LLMOPT_CACHE": str(tmp_path / "empty-cache")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    path, ids = r.stdout.strip().splitlines()[-2:]
    assert path == "eager (the C++ CPU kernels could not be built here)"
    want = LLM(model="tiny", device="cpu", dtype="float32", enforce_eager=True).generate(
        ["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert ids == str(list(want[0].outputs[0].token_ids))
    assert len([line for line in r.stderr.splitlines() if "C++ CPU kernels could not be built" in line]) == 1


def test_compiled_step_reads_the_pool_it_writes():
    """The compiled step's KV writes land where the eager attention reads them: a decode step
    after a compiled one, forced eager, continues the same sequence."""
    if not cpu.available():
        pytest.skip("the C++ CPU kernels cannot be built here")
    llm = LLM(model="tiny", device="cpu", dtype="float32")
    runner = llm.llm_engine.runner
    compiled = runner.backend
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    mixed = []
    engine = llm.llm_engine
    engine.add_request("r", "def fibonacci(n):", params)
    step = 0
    while engine.has_unfinished_requests():
        runner.backend = StepBackend(runner.model, runner.kv_cache) if step % 2 else compiled
        for out in engine.step():
            if out.finished:
                mixed = list(out.outputs[0].token_ids)
        step += 1
    want = LLM(model="tiny", device="cpu", dtype="float32", enforce_eager=True)
    assert mixed == tokens(want, ["def fibonacci(n):"], params)[0]


@needs_kernels
def test_bfloat16_compiled_step_stays_within_bfloat16_of_eager():
    """In bfloat16 the compiled step multiplies by its own matrix-vector kernel (summed in another
    order than torch's matmul), so tokens may part where two logits are within a rounding of each
    other; what must hold is that every step's hidden states and logits are the eager
    path's within bfloat16's precision, recomputed eagerly on the same cache at every step."""
    import torch

    from llmopt.model.forward import run_model

    llm = LLM(model="tiny", device="cpu", dtype="bfloat16", seed=0)
    runner = llm.llm_engine.runner
    assert llm.llm_engine.decode_path == "compiled"
    compiled, gaps = runner.backend, []

    def both(input_ids, meta):
        eager = run_model(runner.model, runner.kv_cache, input_ids, meta).float()
        fast = real(input_ids, meta)  # writes the same slots again, then attends
        logits = (compiled.compute_logits(fast).float(), runner.model.compute_logits(eager.to(fast.dtype)).float())
        gaps.append(((fast.float() - eager).abs().max() / eager.abs().max(),
                     (logits[0] - logits[1]).abs().max() / logits[1].abs().max()))
        return fast

    real, compiled.forward = compiled.forward, both
    tokens(llm, PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(gaps) == 8  # the prompts' step and 7 decode steps
    assert max(float(h) for h, _ in gaps) < 0.03 and max(float(lg) for _, lg in gaps) < 0.03
