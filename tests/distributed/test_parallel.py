"""Tensor and pipeline parallelism on the tiny model: worker processes spawned for real, output
equal to one process, nothing left behind.

One workload exercises everything a step can be: a shared system prompt (prefix caching),
prompts longer than the step's token budget (chunked prefill), and a KV pool too small for
all of them at once (preemption). Greedy tokens must equal the one-process engine's for
TP 2, PP 2 and TP 2 x PP 2; seeded sampling must repeat itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from llmopt import LLM, SamplingParams

# a rank that waits longer than this for a peer raises instead of hanging the test run
os.environ.setdefault("LLMOPT_DIST_TIMEOUT", "90")
# Every process this test process starts inherits this mark, orphans too; `worker_pids` counts only
# marked workers, so those of tests running beside this one (the other xdist worker, a lesson) do not.
MARK = f"LLMOPT_TEST_PROCESS={os.getpid()}"
os.environ["LLMOPT_TEST_PROCESS"] = str(os.getpid())

ENGINE = dict(model="tiny", num_kv_blocks=20, block_size=16, max_num_batched_tokens=48, max_num_seqs=8)
SYSTEM = "You are a helpful assistant. Answer in one short sentence, and be precise. "


def workload():
    prompts = [SYSTEM + q for q in ("What is a list?", "What is a dict?", "Why sort?", "What is a set?")]
    prompts += ["def fibonacci(n):\n    " * 6, "import numpy as np\nimport torch\n" * 5, "class Stack:",
                "The capital of France", "for i in range(10):", "# a long comment " * 8]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 3 * i) for i in range(len(prompts))]
    return prompts, params


def worker_pids() -> list[int]:
    """Every live llmopt worker process started from this test process, directly or not, its
    driver killed or not (callers compare with what was there before)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (b"llmopt.distributed.worker" in cmd and stat.rsplit(")", 1)[1].split()[0] != "Z"
                and MARK.encode() in env):
            found.append(int(entry))
    return found


def wait_no_workers(before: set[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in worker_pids() if p not in before]
        if not left:
            return []
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def reference(one_thread):
    prompts, params = workload()
    llm = LLM(**ENGINE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_greedy_equals_one_process_and_workers_exit(reference, tp, pp):
    before = set(worker_pids())
    prompts, params = workload()
    llm = LLM(**ENGINE, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert len(llm.llm_engine.executor.procs) == tp * pp - 1
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference[0]
        m = llm.get_metrics()
        assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0  # the workload did its job
        assert m["kv_cache_usage_perc"] == 0.0  # every block back in the pool
        # seeded sampling repeats itself (the driver samples, with the request's generator)
        sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=10) for i in range(3)]
        a = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], sampled, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], sampled, use_tqdm=False)]
        assert a == b
        reports = llm.llm_engine.executor.report()
        assert [r["rank"] for r in reports] == list(range(tp * pp))
        if tp > 1:  # every row-parallel layer reduced something on every rank
            assert all(r["allreduce_bytes"] > 0 for r in reports)
        if pp > 1:  # micro-batches overlapped: stage 1 ran one while stage 0 ran the next
            stage0 = next(r for r in reports if r["pp_rank"] == 0)["timeline"]
            stage1 = next(r for r in reports if r["pp_rank"] == 1)["timeline"]
            starts0 = {mb: s for mb, s, _ in stage0}
            assert any(starts0.get(mb + 1, 1e30) < e1 for mb, _, e1 in stage1)
    finally:
        llm.close()
    assert all(p.returncode == 0 for p in llm.llm_engine.executor.procs)
    assert wait_no_workers(before) == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)


def test_unsupported_combinations_are_refused_before_any_process():
    before = set(worker_pids())
    for kwargs, match in [(dict(tensor_parallel_size=4), "tensor_parallel_size=4 cannot split"),
                          (dict(pipeline_parallel_size=7), "exceeds the model's 6 layers"),
                          (dict(tensor_parallel_size=2, quantization="int8"), "quantization='int8'"),
                          (dict(tensor_parallel_size=2, kv_cache_dtype="fp8"), "kv_cache_dtype"),
                          (dict(pipeline_parallel_size=2, speculative_config={
                              "method": "ngram", "num_speculative_tokens": 2}), "speculative_config")]:
        with pytest.raises(ValueError, match=match):
            LLM(model="tiny", **kwargs)
    assert wait_no_workers(before, timeout=1) == []


def test_quantized_checkpoint_refused_under_tp_and_kept_whole_under_pp(tmp_path, one_thread):
    from llmopt.quant import quantize

    folder = tmp_path / "tiny-rtn"
    quantize("tiny", method="rtn", bits=4, group_size=64, out=str(folder), progress=False)
    before = set(worker_pids())
    with pytest.raises(ValueError, match="quantized"):
        LLM(model=str(folder), num_kv_blocks=32, tensor_parallel_size=2)
    prompts, params = ["def fibonacci(n):", "class Stack:"], SamplingParams(temperature=0.0, max_tokens=12)
    ref = [o.outputs[0].token_ids for o in LLM(model=str(folder), num_kv_blocks=32).generate(
        prompts, params, use_tqdm=False)]
    with LLM(model=str(folder), num_kv_blocks=32, pipeline_parallel_size=2) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert wait_no_workers(before) == []


def test_a_dead_worker_is_a_clear_error_and_no_process_is_left(one_thread):
    before = set(worker_pids())
    llm = LLM(model="tiny", num_kv_blocks=16, tensor_parallel_size=2)
    llm.llm_engine.executor.procs[0].kill()
    llm.llm_engine.executor.procs[0].wait()
    with pytest.raises(RuntimeError, match="workers stopped"):
        llm.generate(["def f(x):"], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.close()
    assert wait_no_workers(before) == []


DRIVER = """
import sys, time
from llmopt import LLM, SamplingParams
llm = LLM(model="tiny", num_kv_blocks=32, tensor_parallel_size=2, pipeline_parallel_size=int(sys.argv[1]))
print("pids", *[p.pid for p in llm.llm_engine.executor.procs], flush=True)
while True:
    llm.generate(["def fibonacci(n):"] * 4, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.parametrize("sig,pp", [(signal.SIGINT, 1), (signal.SIGKILL, 2)])
def test_ctrl_c_or_a_killed_driver_leaves_no_worker(tmp_path, sig, pp):
    """Ctrl-C in a terminal reaches the whole process group: the workers ignore it, the driver
    stops at the end of its step and exits, and its workers with it. A driver killed outright
    takes its workers along too (PR_SET_PDEATHSIG)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), str(pp)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids"), line
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(1.0)  # in the middle of generating
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids):
            time.sleep(0.2)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}") and not _zombie(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
