"""`llmopt serve` against a careless or hostile client: no request takes the engine down, bad
input is a 400 naming the field (never a 500 with internal text), non-JSON bodies are refused,
and a shutdown still ends every stream properly.

Each test here is a case that once went wrong. One server process for the module, started with
a 1 s drain timeout; the last test stops it with SIGTERM. The test of a request that breaks a
step runs its server in this process, on loopback, with sampling made to fail for one request.
"""

import json
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from llmopt import SamplingParams
from llmopt.config import EngineConfig
from llmopt.layers import sampler_cpu
from llmopt.server import AsyncLLM, build_app
from llmopt.server.process import ServerProcess, free_port
from test_server import wait_idle

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "256", "--shutdown-timeout", "1"])
    with s:
        yield s


def post(server, body, endpoint="completions", content_type="application/json", **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(f"{server.url}/v1/{endpoint}", content=content, headers=headers, timeout=60, **kw)


def assert_error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert "Traceback" not in err["message"] and "internal error" not in err["message"]
    return err


def still_serves(server):
    r = post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_tiny_temperature_is_greedy_and_the_engine_goes_on(server, tiny_llm):
    """temperature=1e-40 made float32 logits NaN inside the engine thread, which died: every stream
    failed and every later request and /health answered 503."""
    [ref] = tiny_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    r = post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1e-40})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.outputs[0].text
    still_serves(server)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None, "application/jsonp"])
def test_bodies_not_sent_as_json_are_refused(server, content_type):
    """A web page may POST these to any address without a CORS preflight: parsing them as JSON
    anyway let every site the user visits drive the server."""
    r = post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, content_type=content_type)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, content_type="application/json; charset=utf-8")
    assert r.status_code == 200


def test_no_web_page_may_call_by_default(server):
    """Without --allowed-origins there is no CORS at all: a browser refuses another origin's
    preflight (so no JSON post) and keeps the answers of simple requests from the page."""
    r = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


LONE = "\\ud800"  # a JSON escape for half a UTF-16 pair: valid JSON, not valid text
BAD_INPUT = [  # (endpoint, raw body, param): each answered 500 with the exception's text
    ("completions", "[" * 100_000 + "]" * 100_000, None),                     # RecursionError
    ("completions", '{"model": "tiny", "prompt": 1' + "0" * 5000 + "}", None),  # int past 4,300 digits
    ("completions", '{"model": "tiny", "prompt": "hi ' + LONE + '"}', "prompt"),
    ("completions", '{"model": "tiny", "prompt": "hi", "stop": ["' + LONE + '"]}', "stop"),
    ("completions", '{"model": "tiny", "prompt": "hi", "' + LONE + '": 1}', LONE),  # echoed escaped
    ("chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "' + LONE + '"}]}',
     "messages[0].content"),
    ("chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "'
     + LONE + '"}]}]}', "messages[0].content"),
    ("completions", '{"model": "tiny", "prompt": "hi", "temperature": 1' + "0" * 400 + "}", "temperature"),
    ("completions", '{"model": "tiny", "prompt": "hi", "min_tokens": 1, "stop_token_ids": [4096]}', "stop_token_ids"),
    # a regex that matches nothing compiled, then failed its request in a step: a 500
    ("completions", json.dumps({"model": "tiny", "prompt": "hi", "structured_outputs": {"regex": r"[^\s\S]"}}),
     "structured_outputs"),
    ("completions", json.dumps({"model": "tiny", "prompt": "hi", "structured_outputs": {"regex": "a{²}"}}),
     "structured_outputs"),  # was 400 "invalid literal for int() with base 10: '²'"
]


@pytest.mark.parametrize("endpoint, body, param", BAD_INPUT, ids=[str(i) for i in range(len(BAD_INPUT))])
def test_bad_input_is_a_400_naming_the_field(server, endpoint, body, param):
    assert_error(post(server, body, endpoint), 400, param)
    still_serves(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_leads_nowhere_is_a_400_and_the_others_go_on(server, stream):
    """The regex "a[^\\s\\S]" compiles and allows "a", then nothing at all: the request failed in
    a step as an internal error (500) with "the grammar refused token 0". It is the request's
    fault, and the answer (or the stream's error event) now says so. A stream whose request has
    failed before its first output was sent is answered as a plain 400 (nothing is sent until the
    first output; on a loaded machine the "a" and the dead end can arrive together)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": stream,
            "structured_outputs": {"regex": r"a[^\s\S]"}}
    r = post(server, body)
    if stream and r.status_code == 200:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-2]["choices"][0]["finish_reason"] == "error"
        error = events[-1]["error"]
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        error = assert_error(r, 400, None)
    assert error["type"] == "invalid_request_error" and "can never be completed" in error["message"]
    still_serves(server)
    assert wait_idle(server)["llmopt:kv_cache_usage_perc"] == 0.0


def test_a_top_k_past_int64_is_served_as_off(server):
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "top_k": 1' + "0" * 30 + "}"
    assert post(server, body).status_code == 200


def test_stop_strings_are_bounded(server):
    """Any stop string was accepted, and a stream holds back len(stop) - 1 characters."""
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    assert_error(post(server, {**base, "stop": ["a"] * 5}), 400, "stop")
    assert_error(post(server, {**base, "stop": "x" * 65}), 400, "stop")
    assert post(server, {**base, "stop": ["x" * 64, "y", "z", "w"]}).status_code == 200


def test_max_tokens_past_the_context_is_a_400_with_the_numbers(server, tiny_llm):
    """Capped silently before; vLLM's server answers 400 with the numbers, and so does this one."""
    n = len(tiny_llm.tokenizer(PROMPT)["input_ids"])
    err = assert_error(post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2048 - n + 1}), 400,
                       "max_tokens")
    assert "2048" in err["message"] and f"{n} in the prompt" in err["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
    assert "maximum context length" in assert_error(post(server, chat, "chat/completions"), 400,
                                                    "max_completion_tokens")["message"]


# -- a request that breaks a step --------------------------------------------------------------
@pytest.fixture
def poisoned_server():
    """A server in this process whose sampling raises for requests with seed 13, as a parameter
    the sampler cannot take would; everything else is the real server, reached over loopback."""
    real = sampler_cpu.sample  # the default engine's sampler

    def sample(logits, params, generators):
        if any(p.seed == 13 for p in params):
            raise FloatingPointError("injected: sampling failed")
        return real(logits, params, generators)

    sampler_cpu.sample = sample
    llm = AsyncLLM(EngineConfig(model="tiny", device="cpu", num_kv_blocks=256))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(llm), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            assert thread.is_alive()
            time.sleep(0.05)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", llm=llm)
    finally:
        srv.should_exit = True
        thread.join(30)
        sampler_cpu.sample = real


def stream_in_background(url: str, body: dict) -> tuple[threading.Thread, list[str]]:
    """Start a streamed completion in a thread; returns once its first event has arrived, with
    the thread and the list its `data:` payloads go into."""
    events, first = [], threading.Event()

    def read():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    thread = threading.Thread(target=read)
    thread.start()
    assert first.wait(60)
    return thread, events


def test_a_request_that_breaks_a_step_gets_a_500_and_the_others_go_on(poisoned_server, tiny_llm):
    url = poisoned_server.url
    [ref] = tiny_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                              use_tqdm=False)
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    poison = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "seed": 13}
    t, events = stream_in_background(url, long)
    r = httpx.post(f"{url}/v1/completions", json=poison, timeout=60)  # while the stream runs
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert "FloatingPointError" in r.json()["error"]["message"]
    # A stream's headers go out with its first token: one that fails before it is a plain 500 too
    # (a load balancer may still retry it elsewhere; nothing was sent).
    streamed = httpx.post(f"{url}/v1/completions", json={**poison, "stream": True}, timeout=60)
    assert streamed.status_code == 500 and streamed.json()["error"]["type"] == "internal_error"
    t.join(120)
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref.outputs[0].text
    assert events[-1] == "[DONE]"
    assert httpx.get(f"{url}/health").status_code == 200
    assert wait_idle(poisoned_server)["llmopt:kv_cache_usage_perc"] == 0.0
    from prometheus_client.parser import text_string_to_metric_families

    errors = [s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text) for s in f.samples
              if s.name == "llmopt:request_success_total" and s.labels["finished_reason"] == "error"]
    assert errors == [2.0]  # the poison request, once whole and once streamed


def test_a_step_that_raises_outside_the_engines_isolation_fails_its_requests_only(poisoned_server, monkeypatch):
    """A bug in the bookkeeping (here the scheduler) leaves the engine's state in doubt: the requests
    in it fail and the loop goes on with an empty engine, instead of the thread dying."""
    url, scheduler = poisoned_server.url, poisoned_server.llm.engine.scheduler
    real, calls = scheduler.schedule, []

    def schedule():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected: a scheduler bug")
        return real()

    monkeypatch.setattr(scheduler, "schedule", schedule)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and "a scheduler bug" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    assert httpx.get(f"{url}/health").status_code == 200
    assert wait_idle(poisoned_server)["llmopt:kv_cache_usage_perc"] == 0.0


# -- shutdown (last: it stops the module's server) ---------------------------------------------
def test_streams_cut_at_the_shutdown_timeout_end_with_abort_and_done(server):
    """At --shutdown-timeout uvicorn cancelled the streams mid-body: no last chunk, no [DONE]."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t, lines = stream_in_background(server.url, body)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert lines[-1] == "[DONE]"
    usage = json.loads(lines[-2])["usage"]
    last = json.loads(lines[-3])["choices"][0]
    assert last["finish_reason"] == "abort" and 0 < usage["completion_tokens"] < 2000
    assert server.proc.wait(60) == 0
