"""`llmopt router`: one OpenAI endpoint in front of a prefill server and a decode server (vLLM's
disaggregated prefill proxy), both `llmopt serve` with a kv_transfer_config.

For each completion or chat request:
1. the prefill server runs the prompt: the client's body with max_tokens 1, not streamed, and
   `kv_transfer_params: {"do_remote_decode": true}`; its answer's kv_transfer_params name the file
   that now holds the prompt's KV (the prefill server has already let the blocks go);
2. the decode server gets the client's body with those kv_transfer_params; its answer, streamed or
   whole, goes back to the client as it comes.

A request the prefill server refuses is answered with that refusal. If the decode server fails
before it answers (refused, cut off, killed mid-transfer), the client gets OpenAI's error JSON with
status 502, and the transfer file is removed here (the router runs on the same host as the files):
no side holds the prompt's blocks.
"""

from __future__ import annotations

import json
import os

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ROUTES = ("/v1/completions", "/v1/chat/completions")


def error(status: int, message: str, type_: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": None}},
                        status_code=status)


def build_router(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    app = FastAPI(title="llmopt router (disaggregated prefill / decode)")
    client = httpx.AsyncClient(timeout=timeout)

    async def route(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(400, f"the request body is not valid JSON ({e})", "invalid_request_error")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "invalid_request_error")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        first.pop("min_tokens", None)
        try:
            pre = await client.post(prefill_url + path, json=first, headers=headers)
        except httpx.HTTPError as e:
            return error(502, f"the prefill server did not answer ({type(e).__name__})", "bad_gateway")
        if pre.status_code != 200:
            return Response(pre.content, status_code=pre.status_code, media_type="application/json")
        params = pre.json().get("kv_transfer_params")
        if not params:
            return error(502, "the prefill server answered without kv_transfer_params (is it started with "
                              "--kv-transfer-config and kv_role kv_producer?)", "bad_gateway")
        second = {**body, "kv_transfer_params": params}
        try:
            req = client.build_request("POST", decode_url + path, json=second, headers=headers)
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            forget(params)
            return error(502, f"the decode server failed before answering ({type(e).__name__}); the "
                              "prompt's KV was dropped", "bad_gateway")
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            forget(params)
            return Response(content, status_code=resp.status_code, media_type="application/json")
        if not body.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, media_type="application/json")

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
        return StreamingResponse(relay(), media_type="text/event-stream")

    def endpoint(path: str):
        async def handle(request: Request) -> Response:
            return await route(request, path)
        return handle

    for path in ROUTES:
        app.add_api_route(path, endpoint(path), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return error(503, f"{url} is not ready", "service_unavailable")
            except httpx.HTTPError:
                return error(503, f"{url} does not answer", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await client.get(decode_url + "/v1/models", headers=dict(request.headers))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    return app


def forget(params: dict) -> None:
    """Remove a transfer file the decode server will not read (same host)."""
    path = params.get("remote_path")
    if isinstance(path, str) and path.endswith(".kv"):
        try:
            os.unlink(path)
        except OSError:
            pass


def run_router(prefill_url: str, decode_url: str, host: str, port: int) -> int:
    uvicorn.run(build_router(prefill_url.rstrip("/"), decode_url.rstrip("/")), host=host, port=port,
                log_level="warning")
    return 0
