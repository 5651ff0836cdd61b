"""An OpenAI-compatible HTTP server on the engine: `llmopt serve`. (Its clients: the load generator,
the resilient client and the soak live in llmopt.bench: load.py, resilient_client.py, soak.py.)

    protocol.py      OpenAI's request fields, checked one by one; responses and stream chunks
    openapi.py       the same requests as JSON Schema, served in /openapi.json
    async_engine.py  the engine loop in a background thread, one asyncio queue per client
    detokenizer.py   token ids -> text deltas for streaming
    metrics.py       Prometheus metrics (`llmopt:` prefix), recorded after each engine step
    api_server.py    the FastAPI app, server-sent events, graceful shutdown
    security.py      the API key on /v1 routes, CORS (nothing cross-origin unless allowed)
    admission.py     overload and deadlines: a bounded waiting queue (503 + Retry-After), a deadline per request
    lifecycle.py     loading -> ready -> draining, as /health reports it to a load balancer
    process.py       `llmopt serve` as a child process (tests, benchmarks, lessons)
    nginx.py         deploy/nginx.conf rendered for loopback replicas, nginx as a child process
"""

from llmopt.server.api_server import build_app, serve
from llmopt.server.async_engine import AsyncLLM

__all__ = ["AsyncLLM", "build_app", "serve"]
