"""`llmopt serve` with engine flags, and its shutdown: a server started with n-gram
speculative decoding and a small KV pool gives offline-equal greedy text and counts its
drafts in /metrics; a request that could never fit the pool is a 400 naming max_tokens;
SIGTERM while a stream is running lets the stream finish, refuses new work, and exits 0.

The tests share one server and the last one stops it: they run in file order.
"""

import signal
import threading
import time

import httpx
import openai
import pytest

from llmopt import SamplingParams
from llmopt.bench.load import parse_metrics
from llmopt.server.process import ServerProcess

SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
# repetitive code, so that prompt lookup finds n-grams to propose
PROMPT = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range("


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "64", "--max-num-seqs", "8",
                       "--speculative-config", SPEC, "--shutdown-timeout", "60"])
    with s:
        yield s
    assert s.returncode == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_speculative_server_equals_plain_offline_and_counts_drafts(server, client, tiny_llm):
    ref = tiny_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text
    m = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    assert m["llmopt:spec_decode_num_drafts_total"] > 0
    assert 0 <= m["llmopt:spec_decode_num_accepted_tokens_total"] <= m["llmopt:spec_decode_num_draft_tokens_total"]
    per_position = sum(v for k, v in m.items() if k == "llmopt:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_position == m["llmopt:spec_decode_num_accepted_tokens_total"]


def test_request_larger_than_the_kv_pool_is_a_400(server, client):
    # 64 blocks of 16 tokens hold 1,024 tokens; this request may need about 1,500
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1500)
    assert e.value.body["param"] == "max_tokens" and "num_kv_blocks" in e.value.body["message"]
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_sigterm_lets_running_streams_finish_then_exits_0(server, tiny_llm):
    n = 200
    ref = tiny_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    got, first_chunk, chunk_times = {}, threading.Event(), []

    def stream():
        import json

        text, events = "", []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if events[-1]["choices"]:
                        text += events[-1]["choices"][0]["text"]
                        chunk_times.append(time.monotonic())
                        first_chunk.set()
        got["text"], got["events"] = text, events

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(60)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # no new work: /health says so until the listening socket closes
        try:
            r = httpx.get(f"{server.url}/health", timeout=5)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            break  # refused, or accepted into the backlog just as the socket closed (then reset)
        assert r.status_code == 503 and time.monotonic() < deadline
        time.sleep(0.05)
    t.join(120)
    assert chunk_times[-1] > signalled  # it was still running when the signal came
    assert got["text"] == ref.text  # and it finished, every token of it
    assert got["events"][-2]["choices"][0]["finish_reason"] == "length"
    assert got["events"][-1]["usage"]["completion_tokens"] == n
    assert server.proc.wait(60) == 0
