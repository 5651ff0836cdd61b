"""A soak with faults: `llmopt serve` replicas behind the real nginx under steady load, while a
replica is killed and restarted, another drained and restarted, a client stalls, and bodies
arrive oversized or malformed. What it proves is an accounting: every request ends answered,
refused with 503 + Retry-After, or with an error its client saw; none is lost silently.

Requests arrive as a Poisson process, streaming and whole ones mixed (a replica started with
speculative decoding serves part of them), each through a `ResilientClient` (timeouts,
retries with backoff and jitter) pointed at nginx. A sampler reads each replica's /metrics
(KV blocks, queue) and resident memory from /proc twice a second. At the end every replica
must hold no KV block and no request: a block still used then is a leak.
"""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from llmopt.bench.common import percentile
from llmopt.bench.load import parse_metrics
from llmopt.bench.resilient_client import ResilientClient, RetryPolicy
from llmopt.server.nginx import NginxProcess
from llmopt.server.process import ServerProcess, start_all

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import numpy as np\n", "for i in range(",
           "The capital of France is", "def quicksort(xs):"]


@dataclass
class Fault:
    at: float        # seconds after the load starts
    kind: str        # kill | drain | stall | oversized | malformed
    replica: int = 0


@dataclass
class SoakRecord:
    send_time: float
    kind: str                  # stream | whole
    ok: bool
    error: str | None
    attempts: int
    statuses: list
    retry_after_missing: int   # 503 answers without a Retry-After header
    cut: bool
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0


@dataclass
class Soak:
    replica_args: list[list[str]]
    rate: float                      # requests per second
    duration: float                  # seconds of load
    faults: list[Fault] = field(default_factory=list)
    max_tokens: tuple[int, int] = (16, 48)
    seed: int = 0
    client_timeout: float = 60.0
    max_retries: int = 8             # each client's retries of a refused request (Retry-After apart)
    records: list[SoakRecord] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)     # the hostile requests and what they got
    samples: list[dict] = field(default_factory=list)    # per replica, over time
    events: list[dict] = field(default_factory=list)     # faults as they happened

    def run(self) -> dict:
        self.servers = start_all([ServerProcess(a) for a in self.replica_args])
        try:
            with NginxProcess([s.url for s in self.servers]) as lb:
                self.lb = lb
                self._run_load(lb.url)
                self.final = self._settle()
        finally:
            for s in self.servers:
                s.stop(signal.SIGKILL)
        return summarize_soak(self)

    # -- the load -------------------------------------------------------------------------------
    def _run_load(self, url: str) -> None:
        rng = random.Random(self.seed)
        client = ResilientClient(url, timeout=self.client_timeout, failure_threshold=10 ** 6,
                                 retry=RetryPolicy(max_retries=self.max_retries, base_delay=0.25, max_delay=5.0), seed=self.seed)
        self.start = time.monotonic()
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample, args=(stop,), daemon=True)
        sampler.start()
        faults = [threading.Timer(f.at, self._fault, (f,)) for f in self.faults]
        for t in faults:
            t.daemon = True
            t.start()
        t, sends = 0.0, []
        while t < self.duration:
            sends.append(t)
            t += rng.expovariate(self.rate)
        with ThreadPoolExecutor(max_workers=96) as pool:
            futures = []
            for at in sends:
                time.sleep(max(0.0, at - (time.monotonic() - self.start)))
                stream = rng.random() < 0.6
                body = {"model": "tiny", "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(*self.max_tokens),
                        "temperature": 0.0 if rng.random() < 0.5 else 0.8, "ignore_eos": True, "stream": stream}
                futures.append(pool.submit(self._one, client, body, at))
            for f in futures:
                f.result()
        for t in faults:
            t.join()
        stop.set()
        sampler.join()
        client.close()

    def _one(self, client: ResilientClient, body: dict, at: float) -> None:
        sent = time.monotonic()
        r = client.post("/v1/completions", body)
        rec = SoakRecord(send_time=at, kind="stream" if body["stream"] else "whole", ok=r.ok, error=r.error,
                         attempts=len(r.attempts), statuses=[a.status for a in r.attempts],
                         retry_after_missing=sum(a.status == 503 and a.retry_after is None for a in r.attempts),
                         cut=r.cut)
        if r.ok and r.chunk_times:
            rec.ttft = r.chunk_times[0] - sent
            rec.tokens = len(r.chunk_times)
            if rec.tokens > 1:
                rec.tpot = (r.chunk_times[-1] - r.chunk_times[0]) / (rec.tokens - 1)
        elif r.ok and not body["stream"]:
            rec.tokens = r.body["usage"]["completion_tokens"]
            if rec.tokens != body["max_tokens"] or not r.text:  # a 200 that is short: lost, silently
                rec.ok, rec.error = False, None
        if r.ok and body["stream"] and rec.tokens == 0:
            rec.ok, rec.error = False, None
        self.records.append(rec)

    # -- faults ---------------------------------------------------------------------------------
    def _fault(self, f: Fault) -> None:
        now = time.monotonic() - self.start
        server = self.servers[f.replica]
        if f.kind in ("kill", "drain"):
            server.stop(signal.SIGKILL if f.kind == "kill" else signal.SIGTERM, timeout=120)
            down = time.monotonic() - self.start
            fresh = ServerProcess(server.args, port=server.port)  # (its --threads already in args)
            fresh.start()
            self.servers[f.replica] = fresh
            self.events.append({"kind": f.kind, "replica": f.replica, "at": now, "down": down,
                                "ready": time.monotonic() - self.start, "exit_code": server.returncode})
        elif f.kind == "stall":  # a client that sends a streaming request and then never reads
            host, port = self.lb.url.removeprefix("http://").split(":")
            sock = socket.create_connection((host, int(port)))
            body = (b'{"model": "tiny", "prompt": "def f(x):", "max_tokens": 400, "ignore_eos": true, '
                    b'"stream": true}')
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(5.0)
            sock.close()  # gone without a word: the replica must abort it and free its blocks
            self.events.append({"kind": "stall", "at": now, "seconds": 5.0})
        else:
            payload = (b'{"model": "tiny", "prompt": "' + b"x" * (2 << 20) + b'"}' if f.kind == "oversized"
                       else b'{"model": "tiny", "prompt": ')
            # A 503 with Retry-After means no replica could take any request at that moment
            # (all full or restarting): the probe does what every client is told, waits and
            # retries, so what it records is what a replica said of the body itself.
            policy, statuses = RetryPolicy(max_retries=4), []
            for attempt in range(policy.max_retries + 1):
                try:
                    r = httpx.post(f"{self.lb.url}/v1/completions", content=payload, timeout=30,
                                   headers={"Content-Type": "application/json"})
                except httpx.HTTPError as e:
                    statuses.append(f"{type(e).__name__}")
                    break
                statuses.append(r.status_code)
                wait = r.headers.get("retry-after")
                if r.status_code != 503 or wait is None:
                    break
                time.sleep(policy.delay(attempt, wait))
            self.probes.append({"kind": f.kind, "at": now, "status": statuses[-1], "statuses": statuses})

    # -- measurements ---------------------------------------------------------------------------
    def _sample(self, stop: threading.Event) -> None:
        while not stop.is_set():
            now = time.monotonic() - self.start
            for i, s in enumerate(list(self.servers)):
                row = {"time": now, "replica": i, "pid": s.proc.pid, "rss_mb": _rss_mb(s.proc.pid)}
                try:
                    m = parse_metrics(httpx.get(f"{s.url}/metrics", timeout=2).text)
                    row.update(kv_usage=m["llmopt:kv_cache_usage_perc"], running=m["llmopt:num_requests_running"],
                               waiting=m["llmopt:num_requests_waiting"])
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                self.samples.append(row)
            stop.wait(0.5)

    def _settle(self, timeout: float = 60.0) -> list[dict]:
        """Each replica once the load is over: running, waiting, KV blocks still in use."""
        out = []
        for i, s in enumerate(self.servers):
            deadline, m = time.monotonic() + timeout, {}
            while time.monotonic() < deadline:
                m = parse_metrics(httpx.get(f"{s.url}/metrics", timeout=5).text)
                if m["llmopt:num_requests_running"] == 0 and m["llmopt:num_requests_waiting"] == 0:
                    break
                time.sleep(0.2)
            out.append({"replica": i, "running": m.get("llmopt:num_requests_running"),
                        "waiting": m.get("llmopt:num_requests_waiting"),
                        "kv_usage": m.get("llmopt:kv_cache_usage_perc"), "rss_mb": _rss_mb(s.proc.pid)})
        return out


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return None


def summarize_soak(soak: Soak, window: float = 5.0) -> dict:
    recs = soak.records
    for e in soak.events:  # the load a replica's absence had to be carried through
        if "ready" in e:
            inside = [r for r in recs if e["at"] <= r.send_time < e["ready"]]
            e["sent_while_down"], e["answered_while_down"] = len(inside), sum(r.ok for r in inside)
    lost = [r for r in recs if not r.ok and r.error is None]
    refused = [r for r in recs if not r.ok and r.statuses and r.statuses[-1] == 503]
    windows = []
    for k in range(int(soak.duration // window) + 1):
        inside = [r for r in recs if k * window <= r.send_time < (k + 1) * window]
        ttft = [r.ttft for r in inside if r.ttft is not None]
        tpot = [r.tpot for r in inside if r.tpot is not None]
        windows.append({"start": k * window, "requests": len(inside), "answered": sum(r.ok for r in inside),
                        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
                        "tpot_p50_ms": percentile(tpot, 50) * 1e3, "tpot_p99_ms": percentile(tpot, 99) * 1e3})
    return {"requests": len(recs), "answered": sum(r.ok for r in recs),
            "retried": sum(r.attempts > 1 for r in recs), "attempts": sum(r.attempts for r in recs),
            "refused_503": len(refused), "cut": sum(r.cut for r in recs),
            "failed_visibly": sum(not r.ok and r.error is not None for r in recs),
            "lost_silently": len(lost), "answers_503": sum(s == 503 for r in recs for s in r.statuses),
            "answers_503_without_retry_after": sum(r.retry_after_missing for r in recs),
            "errors": sorted({(r.error or "")[:160] for r in recs if not r.ok})[:5],
            "probes": soak.probes, "events": soak.events, "final": soak.final,
            "leaked_kv": [f["replica"] for f in soak.final if f["kv_usage"] not in (0, 0.0)],
            "windows": windows, "samples": soak.samples}
