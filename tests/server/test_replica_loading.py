"""A replica that is not ready yet still answers bad input as bad input: an oversized JSON body
is a 413 and a malformed one a 400, while a well-formed request gets 503 + Retry-After (try
another replica). Without that, a malformed body that meets only loading replicas (one killed
and restarting, the other marked down by nginx after its overload 503s) came back as a 503,
and its client would retry a request no replica will ever take."""

import asyncio

import httpx

from llmopt.server.lifecycle import Replica


def _post(replica: Replica, content: bytes, content_type: str = "application/json") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=replica)  # no lifespan: the replica stays "loading"
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.post("/v1/completions", content=content, headers={"Content-Type": content_type})
    return asyncio.run(go())


def _loading_replica() -> Replica:
    return Replica(load=lambda: (_ for _ in ()).throw(AssertionError("never loaded here")),
                   on_failure=lambda: None, max_request_bytes=1000)


def test_a_loading_replica_names_bad_input_and_asks_good_input_to_retry():
    replica = _loading_replica()
    r = _post(replica, b'{"model": "tiny", "prompt": ')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert "retry-after" not in r.headers
    r = _post(replica, b'{"model": "tiny", "prompt": "' + b"x" * 2000 + b'"}')
    assert r.status_code == 413 and "1,000 bytes" in r.json()["error"]["message"]
    r = _post(replica, b'{"model": "tiny", "prompt": "hi"}')
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "loading" in r.json()["error"]["message"]
    # a body that is not declared JSON is never parsed (a web page may POST text/plain anywhere)
    r = _post(replica, b"{not json", content_type="text/plain")
    assert r.status_code == 503


def test_health_while_loading_is_a_503_naming_the_state():
    async def go():
        transport = httpx.ASGITransport(app=_loading_replica())
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.get("/health")
    r = asyncio.run(go())
    assert r.status_code == 503 and r.json() == {"status": "loading"}
