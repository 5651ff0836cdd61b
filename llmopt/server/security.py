"""Whom `llmopt serve` answers: an API key on the `/v1` routes, and which web pages may call it.

A server on 127.0.0.1 can still be reached by every web page its user opens: the browser
sends the page's requests, and only the CORS rules decide whether the page may send JSON
(which needs a preflight the server must approve) and read the answer. So nothing
cross-origin is allowed unless `--allowed-origins` says so, and bodies that are not JSON
are refused (api_server.py), since those need no preflight. `--api-key` (or LLMOPT_API_KEY,
as vLLM's --api-key / VLLM_API_KEY) then makes every `/v1` request carry
`Authorization: Bearer <key>`; `/health` and `/metrics` stay open for probes and Prometheus.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from dataclasses import dataclass, field

# The command line imports this module to build its parser, so the web stack (and the engine
# behind protocol.py) is imported only where a server is built.

API_KEY_ENV = "LLMOPT_API_KEY"


@dataclass
class Security:
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)  # none: no web page may call the API
    # once an origin is allowed, what the API itself uses: JSON posts with a bearer key
    allowed_methods: list[str] = field(default_factory=lambda: ["GET", "POST"])
    allowed_headers: list[str] = field(default_factory=lambda: ["Authorization", "Content-Type"])
    allow_credentials: bool = False

    @classmethod
    def from_args(cls, args) -> Security:
        """The flags add_security_flags defines; the key from LLMOPT_API_KEY when no flag gives one."""
        return cls(args.api_key or os.environ.get(API_KEY_ENV) or None, args.allowed_origins,
                   args.allowed_methods, args.allowed_headers, args.allow_credentials)

    def apply(self, app) -> None:
        from starlette.middleware.cors import CORSMiddleware

        if self.api_key:
            app.add_middleware(APIKeyMiddleware, api_key=self.api_key)
        if self.allowed_origins:  # added last, so it runs first: a preflight carries no key
            app.add_middleware(CORSMiddleware, allow_origins=self.allowed_origins,
                               allow_methods=self.allowed_methods, allow_headers=self.allowed_headers,
                               allow_credentials=self.allow_credentials)


class APIKeyMiddleware:
    """401 in OpenAI's error JSON for a /v1 request without `Authorization: Bearer <key>`.
    Plain ASGI: a request that passes goes through untouched, event streams and disconnects
    included."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")) and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):  # in constant time: no guessing by timing
                from fastapi.responses import JSONResponse

                from llmopt.server.protocol import APIError

                err = APIError("a valid API key is required: send 'Authorization: Bearer <key>'",
                               status=401, code="invalid_api_key")
                response = JSONResponse(err.to_dict(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security (vLLM spelling)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on /v1 routes (default: ${API_KEY_ENV})")
    g.add_argument("--allowed-origins", type=_json_strings, default=[],
                   help='JSON list of web origins allowed to call the API, e.g. \'["http://localhost:3000"]\' '
                        "(default: none)")
    g.add_argument("--allowed-methods", type=_json_strings, default=["GET", "POST"],
                   help="JSON list of methods allowed cross-origin")
    g.add_argument("--allowed-headers", type=_json_strings, default=["Authorization", "Content-Type"],
                   help="JSON list of request headers allowed cross-origin")
    g.add_argument("--allow-credentials", action="store_true", help="allow cookies on cross-origin calls")


def _json_strings(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, e.g. \'["http://localhost:3000"]\'')
    return value
