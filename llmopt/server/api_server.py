"""`llmopt serve`: the engine behind OpenAI's HTTP API (FastAPI on uvicorn).

    llmopt serve --model tiny --port 8000
    curl http://127.0.0.1:8000/v1/completions -H "Content-Type: application/json" \\
        -d '{"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'

The path of a request: the caller is checked (security.py: API key, CORS), the body is read
(JSON only, up to a size limit) and parsed field by field (protocol.py); the prompt is
tokenized here (a chat's messages through the tokenizer's chat template) and checked against
the engine's limits, so that a bad request gets its 4xx before any engine work. Then it goes to the engine thread (async_engine.py), which
admits it between two steps, and its outputs come back step by step: as server-sent
events in OpenAI's chunk format with `"stream": true`, else as one JSON answer at the end.
A client that disconnects aborts its request; a request the engine fails on gets a 500,
alone. A stream's headers go out with its first token, not before: until then a replica that
dies has sent nothing, and a load balancer can still retry the request elsewhere.

Overload and faults (admission.py, lifecycle.py): a full waiting queue answers 503 with
Retry-After; a request past its deadline is aborted (504, or a stream's last event); /health
says ready only between loading and the first signal. SIGINT / SIGTERM stop admitting, let the
requests in flight finish (up to a timeout, then abort them: a stream still ends with its last
chunk and [DONE]), and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmopt.chat import render_chat
from llmopt.config import EngineConfig
from llmopt.server.admission import AdmissionControl, DeadlineExceeded, Overloaded
from llmopt.server.async_engine import AsyncLLM, EngineUnavailable, RequestFailed
from llmopt.server.detokenizer import IncrementalDetokenizer
from llmopt.server.openapi import request_body, request_schemas
from llmopt.server.lifecycle import Replica
from llmopt.server.protocol import (APIError, ParsedRequest, chat_chunk, chat_response, completion_chunk,
                                    completion_response, new_id, parse_chat, parse_completion, read_json_body,
                                    usage, usage_chunk)
from llmopt.server.security import Security
from llmopt.server.structured_fields import compile_for_request
from llmopt.structured.manager import GrammarDeadEnd

MAX_REQUEST_BYTES = 1 << 20  # 1 MiB of JSON is far more than any prompt max_model_len allows


def build_app(llm: AsyncLLM, max_request_bytes: int = MAX_REQUEST_BYTES,
              security: Security | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        yield
        llm.shutdown()

    app = FastAPI(title="llmopt", lifespan=lifespan)
    app.state.llm = llm
    (security or Security()).apply(app)

    # -- errors in OpenAI's shape -------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # unknown path, wrong method
        err = APIError(f"{e.detail}: {request.method} {request.url.path}", status=e.status_code)
        return JSONResponse(err.to_dict(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        err = APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error")
        return JSONResponse(err.to_dict(), status_code=500)

    # -- endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():  # what a load balancer asks before sending work (lifecycle.py)
        if not llm.healthy:
            return JSONResponse({"status": "failed"}, status_code=503)
        if not llm.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": llm.model_name, "object": "model", "created": 0,
                                            "owned_by": "llmopt", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    bodies = request_schemas(llm.model_name, llm.max_model_len, llm.engine.model_config.vocab_size,
                             llm.engine.config.scheduling_policy == "priority",
                             llm.engine.config.kv_transfer_config is not None)

    @app.post("/v1/completions", openapi_extra=request_body(bodies["/v1/completions"]))
    async def completions(request: Request):
        return await _serve_request(llm, request, chat=False, max_bytes=max_request_bytes)

    @app.post("/v1/chat/completions", openapi_extra=request_body(bodies["/v1/chat/completions"]))
    async def chat_completions(request: Request):
        return await _serve_request(llm, request, chat=True, max_bytes=max_request_bytes)

    return app


# -- one request ---------------------------------------------------------------------------------
def _tokenize(llm: AsyncLLM, req: ParsedRequest) -> tuple[str | None, list[int]]:
    tok = llm.tokenizer
    if req.is_chat:
        try:  # the template writes the special tokens (BOS, turn markers) itself
            return render_chat(tok, req.messages)
        except ValueError as e:  # no template, or the template refused the conversation
            raise APIError(str(e).replace("generate() with a plain prompt", "/v1/completions"),
                           param="messages") from None
    if isinstance(req.prompt, str):
        return req.prompt, tok(req.prompt)["input_ids"]  # with BOS, as LLM.generate does
    return None, list(req.prompt)


async def _serve_request(llm: AsyncLLM, request: Request, chat: bool, max_bytes: int):
    arrival = time.perf_counter()
    body = await read_json_body(request, max_bytes)
    req = parse_chat(body, llm.model_name) if chat else parse_completion(body, llm.model_name)
    if req.priority != 0 and llm.engine.config.scheduling_policy != "priority":
        raise APIError(f"'priority' is {req.priority} but the server schedules first come, first served; "
                       "start it with --scheduling-policy priority", param="priority")
    try:
        timeout = AdmissionControl.parse_timeout(request.headers.get("x-request-timeout"))
    except ValueError as e:
        raise APIError(str(e), param="X-Request-Timeout") from None
    text, ids = _tokenize(llm, req)
    try:
        llm.check(text, ids, req.params)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("prompt"):
            param, msg = ("messages" if chat else "prompt"), msg.replace("prompt 0", "the prompt", 1)
        elif "structured_outputs" in msg:
            param, msg = req.structured_field, msg.replace("request 0", "the request", 1)
        else:
            param = "stop_token_ids" if "stop_token_ids" in msg else req.max_tokens_param
            msg = msg.replace("request 0", "the request", 1)
        raise APIError(msg, param=param) from None
    # a grammar compiles in a worker thread; one that does not compile is a 400 before admission
    await compile_for_request(llm.engine, req.params, req.structured_field, lambda m, p: APIError(m, param=p))
    if not (llm.accepting and llm.healthy):
        llm.metrics.rejected("unavailable")
        raise APIError("the server is shutting down or its engine has stopped; retry elsewhere",
                       status=503, type="service_unavailable", headers={"Retry-After": "1"})
    rid = new_id("chatcmpl" if chat else "cmpl")
    outputs = llm.generate(rid, text, ids, req.params, req.priority, arrival, timeout)

    async def first_output():  # a stream starts with it; a whole answer waits for the last
        return await anext(outputs)

    async def last_output():
        final = None
        async for out in outputs:
            final = out
        return final

    out = await _unless_client_leaves(llm, request, rid, first_output() if req.stream else last_output())
    if out is None:
        return Response(status_code=499)  # nobody is listening any more
    if req.stream:
        return _EventStream(_events(llm, req, rid, len(ids), out, outputs), on_close=lambda: llm.abort(rid))
    c = out.outputs[0]
    use = usage(len(ids), len(c.token_ids))
    make = chat_response if req.is_chat else completion_response
    return make(rid, llm.model_name, c.text, c.finish_reason, use, out.kv_transfer_params)


def failed_request_error(e: RequestFailed) -> APIError:
    """A request the engine failed alone: a 400 where its own constraint dead-ended (GrammarDeadEnd),
    else a 500."""
    if isinstance(e.__cause__, GrammarDeadEnd):
        return APIError(str(e.__cause__), status=400)
    return APIError(str(e), status=500, type="internal_error")


async def _unless_client_leaves(llm: AsyncLLM, request: Request, rid: str, work):
    """Await `work` (the engine's first or last output for the request) unless the client hangs
    up first (then abort the request and return None). Nothing has been sent yet, so every
    failure can still be an HTTP status: 503 overloaded or unavailable, 504 past the deadline,
    500 for an engine failure."""
    async def client_gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(work), asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            llm.abort(rid)
    if work.cancelled():
        return None
    try:
        return work.result()
    except Overloaded as e:
        llm.metrics.rejected("overloaded")
        raise APIError(str(e), status=503, type="service_unavailable", code="overloaded",
                       headers={"Retry-After": str(e.retry_after)}) from None
    except DeadlineExceeded as e:
        raise APIError(str(e), status=504, type="timeout", code="deadline_exceeded") from None
    except EngineUnavailable as e:
        llm.metrics.rejected("unavailable")
        raise APIError(str(e), status=503, type="service_unavailable", headers={"Retry-After": "1"}) from None
    except RequestFailed as e:  # this request only: the engine serves the others on
        raise failed_request_error(e) from None


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def _events(llm: AsyncLLM, req: ParsedRequest, rid: str, n_prompt: int, first, outputs):
    """Server-sent events: a chunk per step that produced text (from `first`, the output already
    received, on), the finish reason on the last, then (if asked) a usage chunk, then `[DONE]`."""

    async def all_outputs():
        yield first
        if not first.finished:
            async for out in outputs:
                yield out

    model, created, chat = llm.model_name, int(time.time()), req.is_chat
    detok = IncrementalDetokenizer(llm.tokenizer, req.params.skip_special_tokens, req.params.stop_strings)
    if chat:
        yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
    n_out = 0
    try:
        async for out in all_outputs():
            c = out.outputs[0]
            n_out = len(c.token_ids)
            delta = detok.step(c.token_ids, c.text if out.finished else None)
            reason = c.finish_reason if out.finished else None
            if delta or reason:
                yield _sse(chat_chunk(rid, model, created, {"content": delta} if delta else {}, reason) if chat
                           else completion_chunk(rid, model, created, delta, reason))
    except EngineUnavailable as e:
        yield _sse(APIError(str(e), status=503, type="service_unavailable").to_dict())
    except DeadlineExceeded as e:  # the text so far stands; a last chunk says it was cut, then why
        yield _sse(chat_chunk(rid, model, created, {}, "abort") if chat
                   else completion_chunk(rid, model, created, "", "abort"))
        yield _sse(APIError(str(e), status=504, type="timeout", code="deadline_exceeded").to_dict())
    except RequestFailed as e:  # a last chunk that says so, then the error itself
        yield _sse(chat_chunk(rid, model, created, {}, "error") if chat
                   else completion_chunk(rid, model, created, "", "error"))
        yield _sse(failed_request_error(e).to_dict())
    except Exception as e:  # the headers are sent: the error can only travel as an event
        yield _sse(APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error").to_dict())
    else:
        if req.include_usage:
            yield _sse(usage_chunk(rid, model, created, chat, usage(n_prompt, n_out)))
    yield _sse("[DONE]")


class _EventStream(StreamingResponse):
    """An SSE response that aborts its request however the stream ends (done, client gone,
    server shutting down); aborting a finished request does nothing."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# -- the process ---------------------------------------------------------------------------------
# uvicorn cancels what still runs this long after the engine's own drain timeout has aborted
# it: by then every stream has sent its last chunk, so this cut only meets a client that stalls.
CANCEL_GRACE_S = 5.0


class _GracefulServer(uvicorn.Server):
    """uvicorn, with three changes: the replica starts draining as soon as a signal arrives
    (it stops admitting; uvicorn closes the port, so a load balancer's next connection goes
    elsewhere); at the drain timeout the requests still running are aborted, so that each stream
    ends with a last chunk (finish_reason "abort") and [DONE] rather than mid-body when uvicorn
    cancels it; and a clean shutdown exits 0 (uvicorn re-raises the signal after shutting down).
    A model that fails to load stops the server with `exit_code` 1 (2 for a bad argument)."""

    def __init__(self, config: uvicorn.Config, replica: Replica, drain_timeout: float):
        super().__init__(config)
        self.replica, self.drain_timeout, self.exit_code = replica, drain_timeout, 0

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.replica.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig, frame) -> None:
        self.replica.drain()
        super().handle_exit(sig, frame)

    def load_failed(self) -> None:  # from the loading thread
        self.exit_code = 2 if isinstance(self.replica.load_error, (ValueError, TypeError)) else 1
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(engine_kwargs: dict, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          threads: int | None = None, shutdown_timeout: float = 30.0,
          max_request_bytes: int = MAX_REQUEST_BYTES, security: Security | None = None,
          max_waiting_requests: int | None = None, request_timeout: float | None = None) -> int:
    """Open the port, load the model (/health answers "loading" meanwhile), serve until
    SIGINT / SIGTERM, return the exit status."""
    import prometheus_client
    import torch

    from llmopt.model.registry import resolve_model

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port!r}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
    prometheus_client.disable_created_metrics()  # no `_created` series beside each counter
    # What can be checked at once is, so that a typo fails before the port opens.
    engine_config = EngineConfig(**engine_kwargs)
    resolve_model(engine_config.model)
    admission = AdmissionControl(max_waiting_requests, request_timeout)
    security = security or Security()

    def load():
        llm = AsyncLLM(engine_config, served_model_name, admission)
        e = llm.engine
        print(f"llmopt serve: model {llm.model_name!r} on {e.device} ({e.dtype}), {e.num_blocks:,} KV blocks of "
              f"{e.block_size} tokens, max_model_len {e.max_model_len}, max_num_seqs {e.config.max_num_seqs}; "
              "ready", flush=True)
        return llm, build_app(llm, max_request_bytes, security)

    if security.api_key:
        print("llmopt serve: /v1 routes require 'Authorization: Bearer <key>'", flush=True)
    elif host not in ("127.0.0.1", "localhost", "::1"):
        print(f"llmopt serve: warning: listening on {host} without --api-key: whoever reaches this port "
              "can use the model", flush=True)
    server = None
    replica = Replica(load, on_failure=lambda: server.load_failed(), max_request_bytes=max_request_bytes)
    config = uvicorn.Config(replica, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + CANCEL_GRACE_S)
    server = _GracefulServer(config, replica, shutdown_timeout)
    server.run()
    return server.exit_code
