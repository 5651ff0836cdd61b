"""A load generator for an OpenAI-compatible server: Poisson arrivals of streaming clients.

Requests arrive as a Poisson process at `rate` per second (independent exponential gaps,
the usual model of many independent users), a fixed number of them, each with a time
limit, so a run always ends. Each client streams its completion and notes when every chunk
came. From those times, as vLLM's `bench serve` computes them:

    TTFT  = first text chunk - request sent      (queueing + prefill)
    TPOT  = (last chunk - first chunk) / (output tokens - 1)     (decode speed seen by one user)
    ITL   = the gaps between chunks
    throughput = output tokens of all requests / (last finish - first send)

A client that behaves: a 503 (the server's queue is full, or it is loading or draining; or,
behind nginx, no replica could take the request) is retried after the `Retry-After` the answer
gives (else an exponential backoff from 0.5 s), with up to 25% random jitter so that refused
clients do not all come back at the same instant, at most `max_retries` times. The summary
counts the 503s; a request's TTFT still starts at its first attempt, as its user waited.

While the load runs, the server's /metrics is read a few times a second (KV cache usage,
running and waiting requests). A server keeps up with a rate while it finishes requests
as fast as they come. Past its capacity (the most requests per second it can finish) a
queue builds for as long as the load lasts, latency climbs and throughput stays flat: that
capacity is the rate at which the server saturates.

Works against `llmopt serve` and against vLLM's server alike (same API, and `ignore_eos`
is one of vLLM's extras too).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmopt.bench.common import percentile


@dataclass
class LoadRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestResult:
    send_time: float                 # seconds since the run started
    index: int = -1                  # the request's place in LoadTest.requests
    ok: bool = False
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since the run started
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    retries_503: int = 0             # 503 answers retried after their Retry-After
    upstream: str | None = None      # behind nginx: the replica(s) tried (its X-Upstream header)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.send_time if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.chunk_times) < 2 or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s) of `num_requests` Poisson arrivals at `rate` per second; inf: all at once."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {rate}")
    if rate == float("inf"):
        return [0.0] * num_requests
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def shared_prefix_requests(token_stream: list[int], num_requests: int, prefix_len: int,
                           suffix_len: tuple[int, int], output_len: int, bos: int | None = None,
                           seed: int = 0) -> list[LoadRequest]:
    """Prompts as token ids: one system prompt (the first `prefix_len` tokens of the stream)
    shared by every request, then a distinct part cut from a random place of the stream."""
    rng = random.Random(seed)
    head = ([bos] if bos is not None else []) + token_stream[:prefix_len]
    out = []
    for _ in range(num_requests):
        n = rng.randint(*suffix_len)
        at = rng.randrange(prefix_len, len(token_stream) - n)
        out.append(LoadRequest(head + token_stream[at:at + n], output_len))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, labels summed away (one model per server)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


# -- one run ---------------------------------------------------------------------------------------
class LoadTest:
    """One bounded run at one rate. `start()` runs it in a background thread (its own event
    loop, so it works the same in a script and in a notebook); `results` and `samples` fill in
    as it goes, for live plots; `wait()` returns the summary."""

    def __init__(self, url: str, requests: list[LoadRequest], rate: float, model: str | None = None,
                 seed: int = 0, timeout: float = 120.0, ignore_eos: bool = True,
                 sample_interval: float = 0.25, progress: bool = False, label: str | None = None,
                 max_retries: int = 5, metrics_url: str | None = None, arrivals: list[float] | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not requests:
            raise ValueError("requests is empty; give at least one LoadRequest")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        self.max_retries = max_retries
        # behind a load balancer, /metrics is one replica's: give a replica's URL, or None to skip sampling
        self.metrics_url = (metrics_url or url).rstrip("/")
        self._rng = random.Random(seed + 7)
        self.url, self.requests, self.rate, self.model = url.rstrip("/"), requests, rate, model
        self.timeout, self.ignore_eos, self.sample_interval = timeout, ignore_eos, sample_interval
        self.progress, self.label = progress, label or f"{rate:g} req/s"
        if arrivals is not None and (len(arrivals) != len(requests) or not all(t >= 0 for t in arrivals)):
            raise ValueError(f"arrivals must give one send time >= 0 s per request ({len(requests)}), got {arrivals!r}")
        # `arrivals`: each request's send time (s) as given; otherwise Poisson at `rate`
        self.arrivals = list(arrivals) if arrivals is not None else poisson_arrivals(len(requests), rate, seed)
        self.results: list[RequestResult] = []   # in order of completion
        self.samples: list[dict[str, float]] = []  # /metrics over time: {"time": s, name: value}
        self.duration: float | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> LoadTest:
        self._thread = threading.Thread(target=self._main, name="llmopt-load", daemon=True)
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> dict:
        if self._thread is None:
            self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return summarize(self)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # handed to wait()
            self._error = e

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout), limits=limits) as client:
            if self.model is None:
                self.model = (await client.get(f"{self.url}/v1/models")).json()["data"][0]["id"]
            bar = None
            if self.progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(self.requests), desc=self.label, unit="req", dynamic_ncols=True)
            start = time.perf_counter()
            sampler = asyncio.ensure_future(self._sample(client, start))

            async def one(index: int, req: LoadRequest, send_at: float) -> None:
                await asyncio.sleep(max(0.0, send_at - (time.perf_counter() - start)))
                result = await self._stream(client, req, start)
                result.index = index
                self.results.append(result)
                if bar is not None:
                    bar.update(1)

            await asyncio.gather(*(one(i, r, t) for i, (r, t) in enumerate(zip(self.requests, self.arrivals))))
            self.duration = time.perf_counter() - start
            sampler.cancel()
            if bar is not None:
                bar.close()

    def backoff(self, attempt: int, retry_after: str | None) -> float:
        """Seconds to wait before retry number `attempt` (0-based) of a 503."""
        try:
            base = float(retry_after) if retry_after is not None else 0.5 * 2 ** attempt
        except ValueError:  # an HTTP date, which no LLM server sends: fall back to the backoff
            base = 0.5 * 2 ** attempt
        return min(base, 30.0) * (1 + 0.25 * self._rng.random())

    async def _stream(self, client: httpx.AsyncClient, req: LoadRequest, start: float) -> RequestResult:
        res = RequestResult(send_time=time.perf_counter() - start)
        while True:
            retry_after = await self._attempt(client, req, start, res)
            if retry_after is False or res.retries_503 >= self.max_retries:
                return res
            await asyncio.sleep(self.backoff(res.retries_503, retry_after))
            res.retries_503 += 1
            res.error = None

    async def _attempt(self, client: httpx.AsyncClient, req: LoadRequest, start: float, res: RequestResult):
        """One try; fills `res`. Returns False when done (answered, or failed for good), else the
        503's Retry-After header (None if it had none)."""
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
                "ignore_eos": self.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                res.upstream = r.headers.get("x-upstream")
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                    return r.headers.get("retry-after") if r.status_code == 503 else False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        res.error = chunk["error"].get("message", "error")
                        return False
                    if chunk.get("usage"):
                        res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        res.chunk_times.append(time.perf_counter() - start)
                        res.text += chunk["choices"][0]["text"]
            res.ok = bool(res.chunk_times)
            if not res.ok:
                res.error = "no text came back"
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
        return False

    async def _sample(self, client: httpx.AsyncClient, start: float) -> None:
        while True:
            try:
                r = await client.get(f"{self.metrics_url}/metrics")
                m = parse_metrics(r.text) if r.status_code == 200 else {}
                m["time"] = time.perf_counter() - start
                self.samples.append(m)
            except httpx.HTTPError:
                pass
            await asyncio.sleep(self.sample_interval)


# -- numbers ----------------------------------------------------------------------------------------
def summarize(run: LoadTest) -> dict:
    """Percentiles of TTFT / TPOT / ITL / e2e (ms), throughput, and the request rates.

    `offered_rate` is the rate the arrivals actually had, (n - 1) / (last send - first send);
    `request_throughput` the rate the server served them, n / (last finish - first send).
    """
    ok = [r for r in run.results if r.ok]
    span = max(r.chunk_times[-1] for r in ok) - min(r.send_time for r in ok) if ok else float("nan")
    offered = (len(run.arrivals) - 1) / run.arrivals[-1] if run.arrivals[-1] > 0 else float("inf")
    out = {"label": run.label, "rate": run.rate, "offered_rate": offered,
           "num_requests": len(run.requests), "completed": len(ok), "failed": len(run.results) - len(ok),
           "errors": sorted({r.error for r in run.results if not r.ok})[:3], "duration_s": run.duration,
           "retried_503": sum(r.retries_503 for r in run.results),
           "requests_retried": sum(r.retries_503 > 0 for r in run.results),
           "request_throughput": len(ok) / span if ok else 0.0,
           "output_throughput": sum(r.output_tokens for r in ok) / span if ok else 0.0,
           "output_tokens": sum(r.output_tokens for r in ok)}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok if r.tpot is not None]),
                         ("itl", [g for r in ok for g in r.itls]), ("e2e", [r.e2e for r in ok])):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q) * 1e3
        out[f"{name}_mean_ms"] = sum(values) / len(values) * 1e3 if values else float("nan")
    if run.samples:
        out["peak_kv_cache_usage"] = max(s.get("llmopt:kv_cache_usage_perc", 0.0) for s in run.samples)
        out["peak_running"] = max(s.get("llmopt:num_requests_running", 0.0) for s in run.samples)
        out["peak_waiting"] = max(s.get("llmopt:num_requests_waiting", 0.0) for s in run.samples)
    return out


def kept_up(summary: dict, share: float = 0.9) -> bool:
    """Did the server serve the requests about as fast as they came (>= `share` of the rate)?"""
    return summary["failed"] == 0 and summary["request_throughput"] >= share * summary["offered_rate"]


def saturation_rate(summaries: list[dict]) -> float | None:
    """Where the server saturates: its capacity, the most requests per second it served at any
    rate tried, provided some rate was more than it could keep up with (None if it kept up
    with all of them: try higher rates). Offered more than its capacity, a server cannot keep
    pace and a queue grows (of waiting requests, or on a CPU of running ones that all slow
    down) for as long as the load lasts: latency climbs and throughput stays flat."""
    if all(kept_up(s) for s in summaries):
        return None
    return max(s["request_throughput"] for s in summaries)


def run_sweep(url: str, requests: list[LoadRequest], rates: list[float], model: str | None = None,
              seed: int = 0, timeout: float = 120.0, progress: bool = True, max_retries: int = 5) -> list[dict]:
    """One bounded run per rate, lowest first, the same requests every time."""
    return [LoadTest(url, requests, rate, model, seed, timeout, progress=progress, max_retries=max_retries).wait()
            for rate in sorted(rates)]


# -- tables and `llmopt bench --url` -------------------------------------------------------------
def load_table(summaries: list[dict]) -> str:
    """One markdown row per rate."""
    head = ["rate (req/s)", "offered", "served req/s", "saturated", "output tok/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
            "TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms", "peak KV usage", "peak running / waiting",
            "503s retried", "failed"]
    rows = []
    for s in summaries:
        rows.append([f"{s['rate']:g}", f"{s['offered_rate']:.2f}", f"{s['request_throughput']:.2f}",
                     "no" if kept_up(s) else "yes", f"{s['output_throughput']:,.0f}",
                     *(f"{s[f'{m}_p{q}_ms']:,.1f}" for m in ("ttft", "tpot") for q in (50, 90, 99)),
                     f"{s.get('peak_kv_cache_usage', float('nan')):.1%}",
                     f"{s.get('peak_running', 0):.0f} / {s.get('peak_waiting', 0):.0f}",
                     f"{s.get('retried_503', 0)}", f"{s['failed']}/{s['num_requests']}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def saturation_line(summaries: list[dict]) -> str:
    capacity = saturation_rate(summaries)
    best = max(summaries, key=lambda s: s["output_throughput"])
    peak = f"peak output throughput {best['output_throughput']:,.0f} tokens/s at {best['rate']:g} req/s"
    if capacity is None:
        return f"saturation: not reached (served < 90% of offered at no rate tried; try higher rates); {peak}"
    return (f"saturation: at about {capacity:.2f} req/s (the most the server served at any rate; rates marked "
            f"saturated were served below 90% of their offered rate); {peak}")


def bench_requests(model: str, num_requests: int, prefix_len: int, suffix_len: tuple[int, int],
                   output_len: tuple[int, int], seed: int = 0) -> list[LoadRequest]:
    """The benchmark's requests, as token ids of `model`'s tokenizer: a shared system prompt of
    held-out code, a distinct part, and an output length drawn from `output_len`."""
    from llmopt.bench.inputs import heldout_tokens
    from llmopt.model.loader import load_tokenizer
    from llmopt.model.registry import resolve_model

    tok = load_tokenizer(resolve_model(model))
    stream = heldout_tokens(tok)
    stream = stream[1:] if stream and stream[0] == tok.bos_token_id else stream
    reqs = shared_prefix_requests(stream, num_requests, prefix_len, suffix_len, output_len[0],
                                  tok.bos_token_id, seed)
    rng = random.Random(seed + 1)
    for r in reqs:
        r.max_tokens = rng.randint(*output_len)
    return reqs


def bench_url(args) -> str:
    """`llmopt bench --url URL --request-rate R ...`: a sweep against a running server; the
    table goes to --out and the numbers to --json when given."""
    rates = args.request_rate or [1.0, 2.0, 4.0, 8.0]
    n = args.num_requests or 32
    prefix_len = args.prefix_len
    suffix = tuple(args.prompt_len or (16, 64))
    output = tuple(args.output_len or (32, 32))
    requests = bench_requests(args.model, n, prefix_len, suffix, output, args.workload_seed)
    summaries = run_sweep(args.url, requests, rates, seed=args.workload_seed, progress=args.progress,
                          max_retries=args.max_retries)
    text = (f"{args.url}: {n} requests per rate, Poisson arrivals (seed {args.workload_seed}), a shared "
            f"{prefix_len}-token system prompt + {suffix[0]}-{suffix[1]} tokens each, "
            f"{output[0]}-{output[1]} output tokens (ignore_eos), streamed; 503s retried after their Retry-After "
            f"(at most {args.max_retries} times)\n\n"
            + load_table(summaries) + "\n\n" + saturation_line(summaries))
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1) + "\n")
    return text
