"""Parallel engines started the other ways: `torchrun` across two "nodes" (two launchers on
loopback, as two machines would run them), `llmopt serve --tensor-parallel-size`, and the
real model (SmolLM2: 9 heads in 3 KV groups, split unevenly over 2 ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from llmopt import LLM, SamplingParams
from llmopt.server.process import ServerProcess, free_port

os.environ.setdefault("LLMOPT_DIST_TIMEOUT", "90")
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def tiny_greedy(one_thread):
    llm = LLM(model="tiny", num_kv_blocks=32)
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]


def test_torchrun_two_nodes_on_loopback(tiny_greedy):
    """Each "node" runs the same command with its --node-rank; rank 0 drives and prints, rank 1
    serves its shard and exits when the driver is done."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port)]
    args = ["-m", "llmopt", "generate", PROMPT, "--max-tokens", "16", "--num-kv-blocks", "32", "--json",
            "--tensor-parallel-size", "2"]
    nodes = [subprocess.Popen(cmd + ["--node-rank", str(r)] + args, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        results = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in results]
    printed = [json.loads(line) for line in results[0][0].splitlines() if line.startswith("{")]
    assert [o["token_ids"] for o in printed] == [tiny_greedy.outputs[0].token_ids]
    assert not results[1][0].strip()  # the worker node prints nothing


def test_serve_with_tensor_and_pipeline_parallel(tiny_greedy):
    args = ["--model", "tiny", "--num-kv-blocks", "32", "--tensor-parallel-size", "2",
            "--pipeline-parallel-size", "2"]
    server = ServerProcess(args).start(timeout=240)
    try:
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"] == tiny_greedy.outputs[0].text
        workers = _children(server.proc.pid)
        assert len(workers) == 3
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert not [p for p in workers if _alive(p)]


def test_smollm2_tp2_x_pp2_greedy_equals_one_process(one_thread):
    """The real model on 4 ranks: heads split 6 + 3 by KV group, vocabulary 24,576 a rank,
    15 layers a stage; chunked prefill and a shared prefix in the workload."""
    prompts = ["The capital of France is", "Write a haiku about the sea. " * 4, "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    engine = dict(model="smollm2", num_kv_blocks=48, max_num_batched_tokens=24)
    ref = [o.outputs[0].token_ids for o in LLM(**engine).generate(prompts, params, use_tqdm=False)]
    with LLM(**engine, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        procs = llm.llm_engine.executor.procs
    assert out == ref
    assert [p.returncode for p in procs] == [0, 0, 0]  # each exited on its own when told to


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
