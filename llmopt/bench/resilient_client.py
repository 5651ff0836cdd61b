"""Client-side degradation: a deadline on every call, retries with backoff and jitter, and a
circuit breaker per replica that stops sending to one that keeps failing.

A server on a bad day refuses (503 + Retry-After), resets connections, or stops answering.
A client that waits forever, or retries at once and all together with every other client,
makes that day worse. So each call has a timeout; a refusal or a failure before the answer
started is retried after `Retry-After` (the server knows its queue) or else after an
exponential backoff, plus random jitter so that refused clients do not return in lockstep.
Each replica has a circuit breaker: after `failure_threshold` failures in a row it opens and
the replica gets nothing for `reset_timeout` seconds; then it is half-open, one request
probes it, and that probe's outcome closes the breaker or opens it again.

A 503 is not a failure for the breaker: it is the replica saying "not now" while healthy. A
refused or reset connection, a timeout, or another 5xx is. A stream that has started is
never retried (its tokens already reached the caller): it ends with an error the caller sees.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

RETRY_STATUSES = (429, 502, 503, 504)  # refused or lost on the way: the request did nothing yet


@dataclass
class RetryPolicy:
    max_retries: int = 4
    base_delay: float = 0.25   # seconds before the first retry when the answer gave no Retry-After
    max_delay: float = 10.0
    jitter: float = 0.5        # up to this share of the delay added at random

    def __post_init__(self):
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        for name in ("base_delay", "max_delay", "jitter"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def delay(self, attempt: int, retry_after: str | None = None, rng: random.Random | None = None) -> float:
        """Seconds before retry number `attempt` (0-based): never sooner than the server's
        Retry-After, else base_delay x 2^attempt; capped, then up to `jitter` of it added."""
        try:
            wait = float(retry_after) if retry_after is not None else self.base_delay * 2 ** attempt
        except ValueError:  # an HTTP date, which no LLM server sends
            wait = self.base_delay * 2 ** attempt
        return min(wait, self.max_delay) * (1 + self.jitter * (rng or random).random())


class CircuitBreaker:
    """closed (requests pass) -> open (none pass) -> half-open (one probe passes) -> closed or open."""

    def __init__(self, failure_threshold: int = 3, reset_timeout: float = 2.0, clock=time.monotonic):
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an integer >= 1, got {failure_threshold!r}")
        if not reset_timeout > 0:
            raise ValueError(f"reset_timeout must be > 0 seconds, got {reset_timeout!r}")
        self.failure_threshold, self.reset_timeout, self.clock = failure_threshold, reset_timeout, clock
        self.state, self.failures, self.opened_at = "closed", 0, 0.0
        self.probing = False
        self.transitions: list[tuple[float, str]] = [(clock(), "closed")]  # for plots: when it changed
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a request go now? In half-open state only one (the probe) is let through."""
        with self._lock:
            if self.state == "open" and self.clock() - self.opened_at >= self.reset_timeout:
                self._set("half_open")
            if self.state == "half_open":
                if self.probing:
                    return False
                self.probing = True
            return self.state != "open"

    def record_success(self) -> None:
        with self._lock:
            self.failures, self.probing = 0, False
            if self.state != "closed":
                self._set("closed")

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1
            self.probing = False
            if self.state == "half_open" or self.failures >= self.failure_threshold:
                self.opened_at = self.clock()
                if self.state != "open":
                    self._set("open")

    def record_refused(self) -> None:
        """A 503: the replica is healthy but busy. The count stays; a refused probe proves nothing,
        so the next request probes again."""
        with self._lock:
            self.probing = False

    def _set(self, state: str) -> None:
        self.state = state
        self.transitions.append((self.clock(), state))


class NoReplicaAvailable(RuntimeError):
    """Every replica's breaker is open: fail fast rather than queue behind dead replicas."""


class ReplicaPool:
    """Replicas behind client-side breakers; `pick()` takes the allowed one with the fewest
    requests in flight (as nginx's least_conn), `done()` reports how its request went."""

    def __init__(self, urls: list[str], failure_threshold: int = 3, reset_timeout: float = 2.0):
        if not urls:
            raise ValueError("urls is empty: give at least one replica URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.breakers = {u: CircuitBreaker(failure_threshold, reset_timeout) for u in self.urls}
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._turn = -1
        self._lock = threading.Lock()

    def pick(self, avoid: tuple[str, ...] = ()) -> str:
        with self._lock:  # ties go round robin: start the scan one replica further each time
            self._turn = (self._turn + 1) % len(self.urls)
            rotated = self.urls[self._turn:] + self.urls[:self._turn]
        order = sorted(rotated, key=lambda u: (u in avoid, self.in_flight[u]))
        for url in order:
            if self.breakers[url].allow():
                with self._lock:
                    self.in_flight[url] += 1
                return url
        raise NoReplicaAvailable(f"every replica's circuit breaker is open ({', '.join(self.urls)}); "
                                 "retry in a moment")

    def done(self, url: str, ok: bool | None) -> None:
        """ok: True (answered), False (failed: counts toward opening), None (a 503: neither)."""
        with self._lock:
            self.in_flight[url] -= 1
        breaker = self.breakers[url]
        if ok:
            breaker.record_success()
        elif ok is False:
            breaker.record_failure()
        else:
            breaker.record_refused()


@dataclass
class Attempt:
    url: str
    status: int | None   # None: no HTTP answer (refused, reset, timed out)
    error: str | None
    seconds: float
    retry_after: str | None = None   # the answer's Retry-After header


@dataclass
class Result:
    ok: bool = False
    status: int | None = None
    body: dict | None = None          # a whole answer's JSON
    text: str = ""                    # the generated text (whole, or the stream's chunks joined)
    error: str | None = None          # what the caller is told when ok is False
    attempts: list[Attempt] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each streamed chunk
    cut: bool = False                 # a stream that started and then broke


def _health(ok: bool, status: int | None, cut: bool) -> bool | None:
    """What an attempt says of its replica: True alive (answered, or refused a bad request), None
    "not now" (a 503), False failing (no answer, a reset, a cut stream, another 5xx)."""
    if status == 503:
        return None
    return ok or (status is not None and status < 500 and not cut)


class ResilientClient:
    """POST /v1/completions (or any route) with a timeout, retries and per-replica breakers.

        client = ResilientClient(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
        r = client.post("/v1/completions", {"model": "tiny", "prompt": "def f(x):", "max_tokens": 16})
        r.ok, r.text, [a.url for a in r.attempts]

    Thread-safe: one client may serve many threads (the breakers are shared, as they should be)."""

    def __init__(self, urls: list[str] | str, timeout: float | httpx.Timeout = 30.0, retry: RetryPolicy | None = None,
                 failure_threshold: int = 3, reset_timeout: float = 2.0, seed: int = 0):
        self.pool = ReplicaPool([urls] if isinstance(urls, str) else list(urls), failure_threshold, reset_timeout)
        self.retry = retry or RetryPolicy()
        self.http = httpx.Client(timeout=timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._rng, self._rng_lock = random.Random(seed), threading.Lock()

    def post(self, path: str, body: dict, headers: dict | None = None) -> Result:
        res, tried = Result(), ()
        for attempt in range(self.retry.max_retries + 1):
            try:
                url = self.pool.pick(avoid=tried)
            except NoReplicaAvailable as e:
                res.error = str(e)
                retry_after = None
            else:
                tried += (url,)
                retry_after = self._attempt(url, path, body, headers, res)
                if res.ok or retry_after is False:
                    return res
            if attempt < self.retry.max_retries:
                with self._rng_lock:
                    wait = self.retry.delay(attempt, retry_after, self._rng)
                time.sleep(wait)
        return res

    def _attempt(self, url, path, body, headers, res: Result):
        """One try. Returns False when there is nothing to retry (answered, a 4xx, a cut
        stream), else the refusal's Retry-After (None when it gave none)."""
        start, stream = time.monotonic(), bool(body.get("stream"))
        status, error, retry_after, ok, header = None, None, None, False, None
        try:
            with self.http.stream("POST", url + path, json=body, headers=headers) as r:
                status, header = r.status_code, r.headers.get("retry-after")
                if status != 200:
                    raw = r.read()
                    error = f"HTTP {status}: {raw.decode(errors='replace')[:300]}"
                    retry_after = r.headers.get("retry-after") if status in RETRY_STATUSES else False
                elif not stream:
                    res.body = json.loads(r.read())
                    res.text = res.body["choices"][0].get("text") or res.body["choices"][0].get(
                        "message", {}).get("content") or ""
                    ok = True
                else:
                    ok, error = self._read_stream(r, res)
                    retry_after = None if not res.chunk_times and not ok else False
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            error = f"{type(e).__name__}: {e}"
            if res.chunk_times:  # it had started: the caller has part of it, nothing to retry
                res.cut, retry_after = True, False
        res.attempts.append(Attempt(url, status, error, time.monotonic() - start, header))
        res.ok, res.status, res.error = ok, status, None if ok else error
        self.pool.done(url, _health(ok, status, res.cut))
        return False if ok else retry_after

    @staticmethod
    def _read_stream(r: httpx.Response, res: Result) -> tuple[bool, str | None]:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return True, None
            event = json.loads(line[6:])
            if event.get("error"):
                res.cut = bool(res.chunk_times)
                return False, f"stream error: {event['error'].get('message', event['error'])}"
            for choice in event.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece:
                    res.text += piece
                    res.chunk_times.append(time.monotonic())
        res.cut = bool(res.chunk_times)
        return False, "the stream ended without [DONE]"

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ResilientClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def call_with_breaker(pool: ReplicaPool, clients: dict, fn):
    """The breaker in front of any client, the official `openai` one included: `clients` maps
    each of `pool.urls` to its client (with its own timeout and max_retries), `fn(client)`
    makes the call. An exception with a status_code (openai.APIStatusError) of 503 or below 500
    leaves the breaker alone; any other (no answer, a timeout, a 5xx) counts as a failure."""
    url = pool.pick()
    try:
        out = fn(clients[url])
    except Exception as e:
        pool.done(url, _health(False, getattr(e, "status_code", None), False))
        raise
    pool.done(url, True)
    return out
