"""Whom `llmopt serve` answers: with `--api-key`, every /v1 route wants `Authorization: Bearer
<key>` (401 in OpenAI's error JSON otherwise) while /health and /metrics stay open; web pages
of other origins get nothing unless `--allowed-origins` names them.

A real server process on loopback, started with a key and one allowed origin; the defaults
(no CORS at all) are checked against a server started without the flags.
"""

import httpx
import openai
import pytest

from llmopt.cli import build_parser
from llmopt.server.process import ServerProcess
from llmopt.server.security import API_KEY_ENV, Security

KEY = "s3cret-key"
GOOD, EVIL = "http://good.example", "http://evil.example"
BODY = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "64", "--api-key", KEY,
                       "--allowed-origins", f'["{GOOD}"]'])
    with s:
        yield s
    assert s.returncode == 0, s.log()


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_v1_routes_need_the_key(server):
    for headers in ({}, auth("wrong"), auth(KEY + "x"), {"Authorization": KEY}):
        for r in (httpx.get(f"{server.url}/v1/models", headers=headers),
                  httpx.post(f"{server.url}/v1/completions", json=BODY, headers=headers),
                  httpx.post(f"{server.url}/v1/chat/completions", json=BODY, headers=headers)):
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", headers=auth()).status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json=BODY, headers=auth()).status_code == 200


def test_the_openai_client_with_and_without_the_key(server):
    ok = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(**BODY).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="guess", max_retries=0).completions.create(**BODY)


def test_health_and_metrics_stay_open(server):
    """Load balancers and Prometheus scrape them without a key, as on vLLM's server."""
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def preflight(server, origin):
    return httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_only_the_allowed_origin_may_call_from_a_browser(server):
    r = preflight(server, GOOD)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = preflight(server, EVIL)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, headers={**auth(), "Origin": GOOD})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, headers={**auth(), "Origin": EVIL})
    assert "access-control-allow-origin" not in r.headers  # the browser keeps the answer from the page


def test_flags_and_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = build_parser().parse_args(["serve"])
    assert Security.from_args(args) == Security()  # no key, no origin: nothing cross-origin
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert Security.from_args(args).api_key == "from-env"
    args = build_parser().parse_args(["serve", "--api-key", "from-flag", "--allowed-origins", '["http://a"]',
                                      "--allowed-methods", '["GET"]', "--allow-credentials"])
    s = Security.from_args(args)
    assert (s.api_key, s.allowed_origins, s.allowed_methods, s.allow_credentials) == (
        "from-flag", ["http://a"], ["GET"], True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "http://a"])  # not a JSON list
