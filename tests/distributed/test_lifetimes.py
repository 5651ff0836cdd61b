"""A learner's habits with parallel LLMs: re-running the cell that builds one, `del`, Ctrl-C in
the middle of a generate, a worker killed from outside. Tensor parallelism 2 on gloo with the
tiny model, worker processes spawned for real; every output is held equal to one process's.

The garbage collector is switched off around the checks that `del` frees an engine: the point
is that reference counting alone stops its workers and frees its pool, at once.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
from test_parallel import wait_no_workers, worker_pids

from llmopt import LLM, SamplingParams

os.environ.setdefault("LLMOPT_DIST_TIMEOUT", "90")
ENGINE = dict(model="tiny", num_kv_blocks=64, max_num_seqs=8)
PROMPTS = ["def fibonacci(n):", "class Stack:", "The capital of France", "import numpy as np\n"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(one_thread):
    return [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)]


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


class gc_off:
    def __enter__(self):
        gc.collect()
        gc.disable()

    def __exit__(self, *exc):
        gc.enable()


def after_steps(llm, n: int, action) -> threading.Thread:
    """Run `action` from another thread once the engine has taken `n` more steps (so that it
    lands in the middle of the generate that follows)."""
    engine, start = llm.llm_engine, llm.llm_engine.step_count

    def watch():
        deadline = time.monotonic() + 120
        while engine.step_count < start + n and time.monotonic() < deadline:
            time.sleep(0.001)
        action()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_rebinding_a_parallel_llm_five_times_and_del_leave_no_worker(reference, caplog):
    """The notebook cell `llm = LLM(..., tensor_parallel_size=2)` run five times: each new LLM
    closes the one still bound to `llm` (with a notice), and `del` stops the last one's workers."""
    before = set(worker_pids())
    with gc_off(), caplog.at_level(logging.WARNING, logger="llmopt.distributed.lifetime"):
        llm = None
        for i in range(5):
            previous = llm
            llm = LLM(**ENGINE, tensor_parallel_size=2)
            assert tokens(llm) == reference
            assert len(set(worker_pids()) - before) == 1  # the previous one's worker is gone
            if previous is not None:
                with pytest.raises(RuntimeError, match="closed by a newer parallel LLM"):
                    previous.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
            del previous
        notices = [r for r in caplog.records if "closing the previous parallel LLM" in r.getMessage()]
        assert len(notices) == 4
        engine = weakref.ref(llm.llm_engine)
        del llm
        assert engine() is None  # freed by reference counting, not by a later gc pass
        assert set(worker_pids()) - before == set()  # stopped within `del`, not eventually


def test_ctrl_c_in_the_middle_of_a_parallel_generate_leaves_a_usable_llm(reference):
    with LLM(**ENGINE, tensor_parallel_size=2) as llm:
        for steps in (1, 9):
            after_steps(llm, steps, lambda: os.kill(os.getpid(), signal.SIGINT))
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS * 2, PARAMS, use_tqdm=False)
            engine = llm.llm_engine
            assert not engine.has_unfinished_requests() and not engine.requests
            assert engine.get_metrics()["kv_cache_usage_perc"] == 0.0  # every block back in the pool
            assert tokens(llm) == reference  # the workers are in step with the driver


def test_a_killed_worker_is_an_error_naming_its_rank_and_a_new_llm_builds_after(reference):
    before = set(worker_pids())
    llm = LLM(**ENGINE, tensor_parallel_size=2)
    victim = llm.llm_engine.executor.procs[0]
    after_steps(llm, 3, victim.kill)
    with pytest.raises(RuntimeError, match=r"rank 1 \(killed by SIGKILL\)") as e:
        llm.generate(PROMPTS * 4, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), use_tqdm=False)
    assert "a new LLM can be built" in str(e.value)
    with pytest.raises(RuntimeError, match="rank 1"):  # and it stays a clear error
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    assert wait_no_workers(before) == []
    with LLM(**ENGINE, tensor_parallel_size=2) as fresh:
        assert tokens(fresh) == reference
    assert wait_no_workers(before) == []


RSS_SCRIPT = """
import gc, json, torch
from llmopt import LLM, SamplingParams

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

torch.set_num_threads(1)
gc.disable()   # reference counting alone must free each engine
engine = dict(model="tiny", num_kv_blocks=2048)
LLM(**engine).generate("x", SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up: imports, caches
rows = []
for tp in (1, 2, 1, 2):
    base = rss_mb()
    llm = LLM(**engine, tensor_parallel_size=tp)
    llm.generate(["def f(x):"] * 4, SamplingParams(max_tokens=16), use_tqdm=False)
    held = rss_mb()
    weights = sum(p.nbytes for p in llm.llm_engine.model.parameters()) / 2**20   # the driver's shard
    del llm
    rows.append({"tp": tp, "base": base, "held": held, "weights": weights, "after": rss_mb()})
print(json.dumps(rows))
"""


def test_del_gives_every_engines_memory_back(tmp_path):
    """RSS after `del` is back at what it was before the LLM was built, for one-process and
    parallel engines alike (measured in a fresh process, the collector off)."""
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "LLMOPT_DIST_TIMEOUT": "90"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    for r in rows:
        grew = r["held"] - r["base"]
        # the weights in this process (at tp=2 the driver's shard: 16 MB of tiny's 32) and the
        # touched part of the pool: what `del` must give back is at least the weights
        assert grew > r["weights"], r
        # measured: 1-6 MB stays whatever the engine's size (allocator bookkeeping, caches), under
        # half of the 16 MB shard; without the engine's HostMemoryRelease, the tp=2 engines left
        # 42-53 MB (glibc kept the freed heap pages), more than their weights
        assert r["after"] - r["base"] < 0.5 * r["weights"], r
