"""A replica's life as its load balancer sees it: loading -> ready -> draining -> gone.

A load balancer should send a request only to a replica that can take it, and `GET /health`
says which: 200 `{"status": "ok"}` once the model is loaded and until the first shutdown
signal; 503 with `"loading"`, `"draining"` or `"failed"` otherwise. The port opens *before*
the model loads (seconds on a laptop, minutes for a large model on a GPU), so that a health
check sees a replica loading rather than a closed port. Until the replica is ready, every
other route answers 503 with `Retry-After`, which nginx (`proxy_next_upstream http_503`)
takes as "try the next replica", as it does a draining replica's 503s.

`Replica` is the ASGI application uvicorn runs: it answers for itself while loading and
hands every request to the FastAPI app (api_server.build_app) once the engine is up. It also
owns the engine's lifetime (start after loading, shut down with the server), so the inner
app's own lifespan is not used.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from llmopt.server.async_engine import AsyncLLM
from llmopt.server.protocol import APIError, read_json_body


class Replica:
    def __init__(self, load: Callable[[], tuple[AsyncLLM, object]], on_failure: Callable[[], None],
                 max_request_bytes: int = 1 << 20):
        """`load()` builds the engine and the app (it runs in a thread, off the event loop);
        `on_failure()` is called if it raises, after the error is printed (to stop the server).
        `max_request_bytes` bounds the body read while not ready (see _not_ready)."""
        self._load, self._on_failure = load, on_failure
        self.max_request_bytes = max_request_bytes
        self.llm: AsyncLLM | None = None
        self.app = None
        self.state = "loading"           # loading | ready | draining | failed
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()  # set when loading ends, either way

    # -- transitions ----------------------------------------------------------------------------
    def _load_in_background(self) -> None:
        try:
            llm, app = self._load()
            llm.start()
        except BaseException as e:  # noqa: BLE001 - printed, then the server exits non-zero
            self.load_error, self.state = e, "failed"
            kind = "error" if isinstance(e, (ValueError, TypeError)) else "failed to load the model"
            print(f"llmopt serve: {kind}: {e}", file=sys.stderr, flush=True)
            if kind != "error":
                traceback.print_exc()
            self.loaded.set()
            self._on_failure()
            return
        self.llm, self.app = llm, app
        if self.state == "loading":   # a signal during loading leaves it draining
            self.state = "ready"
        else:
            llm.accepting = False
        self.loaded.set()

    def drain(self) -> None:
        """Stop admitting: /health answers 503 "draining" and new requests 503; running ones go on."""
        if self.state in ("loading", "ready"):
            self.state = "draining"
        if self.llm is not None:
            self.llm.accepting = False

    def abort_all(self) -> None:
        if self.llm is not None:
            self.llm.abort_all()

    # -- ASGI ----------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._not_ready(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                threading.Thread(target=self._load_in_background, name="llmopt-load", daemon=True).start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.llm is not None:
                    self.llm.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _not_ready(self, scope, receive, send) -> None:
        if scope["path"] == "/health":
            status, body = 503, {"status": self.state}
        else:
            # Bad input is answered as such in every state: a body that is too large or not JSON
            # would be refused by a ready replica too, so "retry elsewhere" would only send it
            # round the load balancer to get the same 413/400 later (or, if every replica is
            # loading or marked down, never). Only a well-formed request is told to retry.
            refused = await self._check_body(scope, receive)
            why = "its model is loading" if self.state == "loading" else "it is stopping"
            refused = refused or APIError(f"the server is not ready: {why}; retry shortly or on another replica",
                                          status=503, type="service_unavailable")
            status, body = refused.status, refused.to_dict()
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status,
                    "headers": headers + ([(b"retry-after", b"1")] if status == 503 else [])})
        await send({"type": "http.response.body", "body": data})

    async def _check_body(self, scope, receive) -> APIError | None:
        """The ready app's own error (protocol.read_json_body: 413, 400) for a JSON body that is
        too large or malformed; None else. A body not declared JSON is not read."""
        headers = dict(scope.get("headers") or [])
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope.get("method") != "POST" or media_type != b"application/json":
            return None
        try:
            await read_json_body(Request(scope, receive), self.max_request_bytes)
        except APIError as e:
            return e
        except ClientDisconnect:
            pass
        return None
