"""`llmopt serve` tested as a client sees it: a real server process on 127.0.0.1, driven
over HTTP with the official `openai` client (and raw httpx where a client must misbehave).

Greedy outputs equal `LLM.generate` offline for the same prompt, streamed or not, alone or
among 32 concurrent streams; a client that disconnects frees its KV blocks; every bad input
gets a 4xx in OpenAI's error JSON naming the field, and the server goes on; /metrics is
Prometheus text. One server for the whole module; the fixture stops it with SIGINT and
checks that it exits 0.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest

from llmopt import SamplingParams
from llmopt.bench import heldout_text
from llmopt.bench.load import LoadRequest, LoadTest, parse_metrics, shared_prefix_requests, summarize
from llmopt.server.process import ServerProcess

NUM_KV_BLOCKS = 512
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(["--model", "tiny", "--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                       "--max-num-seqs", "64"])
    with s:
        yield s
    assert s.returncode == 0, f"SIGINT should shut the server down cleanly:\n{s.log()}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def offline(llm, prompts, max_tokens, **kw):
    """What LLM.generate gives for the same prompts, greedy."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, **kw) for m in max_tokens]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{server.url}/metrics").text)


def wait_idle(server, timeout=30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits; the numbers then."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["llmopt:num_requests_running"] == 0 and m["llmopt:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server is still busy after {timeout} s: {m}"
        time.sleep(0.1)


# -- the happy paths ----------------------------------------------------------------------------
def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_completion_equals_offline(client, tiny_llm):
    [ref] = offline(tiny_llm, [PROMPT], [16])
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    n_prompt = len(tiny_llm.tokenizer(PROMPT)["input_ids"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref.token_ids))
    assert r.usage.total_tokens == n_prompt + len(ref.token_ids)


def test_streamed_completion_equals_offline(client, tiny_llm):
    [ref] = offline(tiny_llm, [PROMPT], [20])
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert len(text_chunks) > 3  # streamed in pieces, not at the end
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


def test_token_id_prompt_and_stop_string(client, tiny_llm):
    ids = [1, 319, 260]
    [ref] = offline(tiny_llm, [{"prompt_token_ids": ids}], [24])
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == 3
    # a stop string cuts the text where it starts; the streamed text never shows it
    stop = ref.text[5:8]
    [ref_stop] = offline(tiny_llm, [{"prompt_token_ids": ids}], [24], stop=[stop])
    assert ref_stop.finish_reason == "stop" and stop not in ref_stop.text
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0, stop=[stop])
    streamed = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0, stop=[stop],
                                         stream=True)
    pieces = [c.choices[0] for c in streamed]
    assert whole.choices[0].text == "".join(p.text for p in pieces) == ref_stop.text
    assert whole.choices[0].finish_reason == pieces[-1].finish_reason == "stop"


def chat_reference(llm, messages, max_tokens):
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    [ref] = offline(llm, [{"prompt_token_ids": list(ids)}], [max_tokens])
    return ref, len(ids)


def test_chat_equals_offline(client, tiny_llm):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that reverses a list."}]
    ref, n_prompt = chat_reference(tiny_llm, messages, 16)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.prompt_tokens == n_prompt
    # content given as parts, and max_completion_tokens (newer clients) mean the same
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    r2 = client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=16, temperature=0)
    assert r2.choices[0].message.content == ref.text


def test_32_concurrent_streams_equal_offline(server, tiny_llm):
    text = heldout_text()
    prompts = [text[2000 + 997 * i: 2000 + 997 * i + 60 + 13 * i] for i in range(32)]
    max_tokens = [6 + i % 7 for i in range(32)]
    refs = offline(tiny_llm, prompts, max_tokens)
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

    async def one(prompt, m):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=m, temperature=0,
                                                  stream=True)
        pieces = [c.choices[0] async for c in stream]
        return "".join(p.text for p in pieces), pieces[-1].finish_reason

    async def all_at_once():
        return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens)))

    before = metrics(server)
    got = asyncio.run(all_at_once())
    assert [g[0] for g in got] == [r.text for r in refs]
    assert [g[1] for g in got] == [r.finish_reason for r in refs]
    after = wait_idle(server)
    assert after["llmopt:generation_tokens_total"] - before["llmopt:generation_tokens_total"] == sum(
        len(r.token_ids) for r in refs)
    assert after["llmopt:kv_cache_usage_perc"] == 0.0


# -- clients that leave -------------------------------------------------------------------------
def aborted(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "llmopt:request_success_total" and s.labels["finished_reason"] == "abort")


def test_disconnect_mid_stream_frees_blocks(server):
    idle = wait_idle(server)
    assert idle["llmopt:kv_cache_usage_perc"] == 0.0
    aborted_before = aborted(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]  # a few chunks, then hang up
    assert sum(line.startswith("data: ") for line in got) >= 3
    after = wait_idle(server)
    assert after["llmopt:kv_cache_usage_perc"] == idle["llmopt:kv_cache_usage_perc"]
    assert aborted(server) == aborted_before + 1
    assert after["llmopt:generation_tokens_total"] - idle["llmopt:generation_tokens_total"] < 1500


def test_disconnect_while_waiting_for_a_whole_answer(server):
    idle = wait_idle(server)
    aborted_before = aborted(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    after = wait_idle(server)
    assert after["llmopt:kv_cache_usage_perc"] == 0.0 and aborted(server) == aborted_before + 1
    assert after["llmopt:generation_tokens_total"] - idle["llmopt:generation_tokens_total"] < 1500


# -- bad input ------------------------------------------------------------------------------------
def long_prompt_ids():
    return [5] * 2100  # max_model_len is 2048


BAD = [  # (endpoint, body, status, param); a str body is sent as it is
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("completions", {"model": "tiny"}, 400, "prompt"),
    ("completions", {"prompt": PROMPT}, 400, "model"),
    ("completions", {"model": "tiny", "prompt": 42}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "temperature": -0.5}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "n": 2}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "max_token": 5}, 400, "max_token"),
    ("completions", {"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": long_prompt_ids()}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "seed": 2**64}, 400, "seed"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "priority": 3}, 400, "priority"),  # fcfs server
    ("completions", {"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
    ("completions", {"model": "tiny", "prompt": "x" * (2 << 20)}, 413, None),
    ("chat/completions", {"model": "tiny"}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x " * 3000}],
                          "max_tokens": 4}, 400, "messages"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD,
                         ids=[f"{e}-{p or 'body'}-{i}" for i, (e, _, _, p) in enumerate(BAD)])
def test_bad_input_gets_openai_error_and_the_server_goes_on(server, client, endpoint, body, status, param):
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=content,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err["message"] or "prompt" in err["message"]
    # the server still answers, correctly
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"


def test_unknown_path_and_method(server):
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and "/v1/nothing-here" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


# -- metrics and load ----------------------------------------------------------------------------
def test_metrics_are_prometheus_text(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    kinds = {
        "llmopt:time_to_first_token_seconds": "histogram", "llmopt:inter_token_latency_seconds": "histogram",
        "llmopt:e2e_request_latency_seconds": "histogram", "llmopt:request_queue_time_seconds": "histogram",
        "llmopt:num_requests_running": "gauge", "llmopt:num_requests_waiting": "gauge",
        "llmopt:kv_cache_usage_perc": "gauge", "llmopt:prefix_cache_queries": "counter",
        "llmopt:prefix_cache_hits": "counter", "llmopt:num_preemptions": "counter",
        "llmopt:prompt_tokens": "counter", "llmopt:generation_tokens": "counter",
        "llmopt:request_success": "counter", "llmopt:spec_decode_num_drafts": "counter",
        "llmopt:spec_decode_num_draft_tokens": "counter", "llmopt:spec_decode_num_accepted_tokens": "counter"}
    assert {n: families[n].type for n in kinds if n in families} == kinds
    m = wait_idle(server)
    finished = sum(v for k, v in m.items() if k == "llmopt:request_success_total")
    # every request that got a token has one TTFT; every finished one that was not aborted, an e2e
    assert m["llmopt:time_to_first_token_seconds_count"] >= m["llmopt:e2e_request_latency_seconds_count"] > 0
    assert m["llmopt:e2e_request_latency_seconds_count"] <= finished
    assert m["llmopt:inter_token_latency_seconds_count"] <= m["llmopt:generation_tokens_total"]
    assert 0 < m["llmopt:prefix_cache_hits_total"] <= m["llmopt:prefix_cache_queries_total"]
    assert m["llmopt:spec_decode_num_drafts_total"] == 0  # no speculative decoding on this server


def test_load_test_against_the_server(server, tiny_llm):
    stream = tiny_llm.tokenizer(heldout_text()[:20000], add_special_tokens=False)["input_ids"]
    requests = shared_prefix_requests(stream, 12, prefix_len=64, suffix_len=(8, 24), output_len=6,
                                      bos=tiny_llm.tokenizer.bos_token_id, seed=1)
    refs = offline(tiny_llm, [{"prompt_token_ids": r.prompt} for r in requests], [6] * 12, ignore_eos=True)
    run = LoadTest(server.url, requests, rate=40.0, seed=3, sample_interval=0.05)
    s = run.wait()
    assert s["completed"] == 12 and s["failed"] == 0 and s["output_tokens"] == 72
    assert sorted(r.text for r in run.results) == sorted(r.text for r in refs)
    assert sorted(r.index for r in run.results) == list(range(12))
    for r in run.results:
        assert r.text == refs[r.index].text  # each result knows its request
        assert 0 < r.ttft <= r.e2e and r.output_tokens == 6 and r.tpot > 0
    assert s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_p99_ms"]
    assert s["tpot_p50_ms"] <= s["tpot_p99_ms"] and s["output_throughput"] > 0
    assert run.samples and all("llmopt:kv_cache_usage_perc" in x for x in run.samples)
    assert summarize(run)["completed"] == 12


def test_load_test_sends_at_the_times_given(server):
    requests = [LoadRequest([5, 6, 7, 8], 2) for _ in range(3)]
    run = LoadTest(server.url, requests, rate=1.0, arrivals=[0.0, 0.4, 0.2])
    assert run.wait()["completed"] == 3
    for r in run.results:
        assert r.send_time >= [0.0, 0.4, 0.2][r.index]
    for bad in ([0.0, 0.1], [0.0, -1.0, 0.2]):
        with pytest.raises(ValueError, match="one send time >= 0 s per request"):
            LoadTest(server.url, requests, rate=1.0, arrivals=bad)


def test_bench_url_sweeps_a_running_server(server, tmp_path):
    from llmopt.cli import main

    out, raw = tmp_path / "load.md", tmp_path / "load.json"
    assert main(["bench", "--url", server.url, "--request-rate", "8", "inf", "--num-requests", "4",
                 "--prefix-len", "32", "--prompt-len", "4", "8", "--output-len", "3", "3", "--no-progress",
                 "--out", str(out), "--json", str(raw)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit() or "| inf" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["8", "inf"] and "saturation:" in text
    runs = json.loads(raw.read_text())
    assert [r["completed"] for r in runs] == [4, 4] and all(r["output_tokens"] == 12 for r in runs)
