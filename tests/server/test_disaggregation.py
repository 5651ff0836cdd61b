"""Disaggregated prefill and decode behind `llmopt router`, on loopback: a prefill server
(kv_producer) and a decode server (kv_consumer) hand each prompt's KV over through a file in shared
memory. Held here: greedy answers through the router equal one engine's, streamed or whole; the
prefill server holds no block once it answered; a decode server killed mid-transfer leaves the
client an error it can read, no transfer file, and no block held by the prefill server."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from llmopt import LLM, SamplingParams
from llmopt.bench.load import parse_metrics
from llmopt.server.process import RouterProcess, ServerProcess

PROMPTS = ["def fibonacci(n):", "Conversation: " + " ".join(f"w{j}" for j in range(50)),
           "The capital of France is a city where " * 4]


def engine_args(role: str, folder) -> list[str]:
    config = ('{"kv_connector": "SharedMemoryConnector", "kv_role": "%s", '
              '"kv_connector_extra_config": {"path": "%s"}}' % (role, folder))
    return ["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "128", "--kv-transfer-config", config]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def servers(folder):
    pre, dec = ServerProcess(engine_args("kv_producer", folder)), ServerProcess(engine_args("kv_consumer", folder))
    with pre, dec:
        with RouterProcess(pre.url, dec.url) as router:
            yield pre, dec, router


def complete(url: str, prompt: str, stream: bool = False, max_tokens: int = 10) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_disaggregated_answers_equal_one_engines(servers, folder):
    pre, dec, router = servers
    llm = LLM("tiny", num_kv_blocks=128)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10),
                                                      use_tqdm=False)]
    assert [complete(router.url, p) for p in PROMPTS] == want
    assert [complete(router.url, p, stream=True) for p in PROMPTS] == want
    m_pre, m_dec = (parse_metrics(httpx.get(f"{s.url}/metrics").text) for s in (pre, dec))
    assert m_pre["llmopt:kv_cache_usage_perc"] == 0  # the prefill server let every prompt's blocks go
    assert m_dec["llmopt:external_prefix_cache_hits_total"] > 0  # the decode server loaded them
    assert not list(folder.glob("*.kv"))  # every transfer file read and removed


def test_a_decode_server_killed_mid_transfer(servers, folder):
    """The last test of this file: it kills the module's decode server (starting three more processes
    for it alone cost about as much as the rest of the file)."""
    pre, dec, router = servers
    dec.proc.send_signal(signal.SIGSTOP)  # it takes the connection but never answers
    answer = {}
    prompt = "A prompt the decode server has not seen: " + " ".join(f"v{j}" for j in range(40))
    client = threading.Thread(target=lambda: answer.update(r=httpx.post(
        f"{router.url}/v1/completions", timeout=120,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0})))
    client.start()
    deadline = time.monotonic() + 60
    while not list(folder.glob("*.kv")):  # the prefill server has answered: the KV is in flight
        assert time.monotonic() < deadline, "no transfer file appeared"
        time.sleep(0.05)
    dec.proc.send_signal(signal.SIGKILL)
    client.join(60)
    r = answer["r"]
    assert r.status_code == 502 and "decode server" in r.json()["error"]["message"], r.text
    assert not list(folder.glob("*.kv"))
    m = parse_metrics(httpx.get(f"{pre.url}/metrics").text)
    assert m["llmopt:kv_cache_usage_perc"] == 0 and m["llmopt:num_requests_running"] == 0
    assert httpx.get(f"{router.url}/health").status_code == 503  # the router says its decode side is gone
