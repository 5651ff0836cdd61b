"""The server's Prometheus metrics, named as vLLM names them with an `llmopt:` prefix.

Four kinds of numbers, as an operator's dashboard reads them:
- gauges of the engine's state now: requests running and waiting, KV cache usage;
- counters that only grow: tokens, finished requests by reason, preemptions, prefix-cache
  queries and hits, speculative drafts and accepted tokens (the engine keeps the running
  totals; each step adds what changed);
- histograms of latencies per request: time to first token (TTFT), inter-token latency
  (ITL, whose mean per request is its TPOT), end-to-end latency, time spent queued;
- what admission control turned away (admission.py): requests refused with 503, by reason
  ("overloaded": the waiting queue was full; "unavailable": loading, draining or failed), and
  requests aborted at their deadline.

Everything is recorded from the engine's thread after each step; `GET /metrics` renders
the registry as Prometheus text. Each server has its own registry, so several can live in
one process (tests, notebooks).
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets spanning a tiny model on a laptop CPU to a large one on a busy GPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)
# engine counter (LLMEngine.get_metrics key) -> Prometheus counter name and help
COUNTERS = {
    "prompt_tokens": ("llmopt:prompt_tokens", "Prompt tokens admitted."),
    "generation_tokens": ("llmopt:generation_tokens", "Tokens generated."),
    "num_preemptions": ("llmopt:num_preemptions", "Requests preempted (KV freed, recomputed later)."),
    "prefix_cache_queries": ("llmopt:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("llmopt:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    # the offload tier below the pool (kv_offloading_size): vLLM's names for hits from outside the pool
    "external_prefix_cache_queries": ("llmopt:external_prefix_cache_queries",
                                      "Prompt tokens looked up below the KV pool (the offload tier)."),
    "external_prefix_cache_hits": ("llmopt:external_prefix_cache_hits",
                                   "Prompt tokens loaded from the offload tier instead of recomputed."),
    "kv_offload_stored_blocks": ("llmopt:kv_offload_stored_blocks", "KV blocks written to the offload tier."),
    "kv_offload_refused_blocks": ("llmopt:kv_offload_refused_blocks",
                                  "Offloaded KV blocks that failed their checksum (recomputed, never used)."),
    "spec_decode_num_drafts": ("llmopt:spec_decode_num_drafts", "Speculative draft runs verified."),
    "spec_decode_num_draft_tokens": ("llmopt:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("llmopt:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}
PER_POSITION = re.compile(r"spec_decode_num_accepted_tokens_per_pos_(\d+)$")
PER_TIER = re.compile(r"kv_offload_hits_(\w+)$")


class ServerMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.num_requests_running = Gauge("llmopt:num_requests_running", "Requests in the running batch.",
                                          labels, registry=r)
        self.num_requests_waiting = Gauge("llmopt:num_requests_waiting", "Requests queued for admission.",
                                          labels, registry=r)
        self.kv_cache_usage = Gauge("llmopt:kv_cache_usage_perc", "Share of KV blocks in use (1 = full).",
                                    labels, registry=r)
        self.counters = {key: Counter(name, help_, labels, registry=r) for key, (name, help_) in COUNTERS.items()}
        self.accepted_per_position = Counter(
            "llmopt:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
            labels + ["position"], registry=r)
        self.offload_hits = Counter("llmopt:kv_offload_hits", "Prompt tokens loaded from an offload tier, by tier.",
                                    labels + ["tier"], registry=r)
        self.request_success = Counter("llmopt:request_success", "Finished requests, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.request_rejected = Counter("llmopt:request_rejected", "Requests refused with 503, by reason.",
                                        labels + ["reason"], registry=r)
        self.request_timeouts = Counter("llmopt:request_timeouts", "Requests aborted at their deadline.",
                                        labels, registry=r)
        self.ttft = Histogram("llmopt:time_to_first_token_seconds", "Arrival to first generated token.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llmopt:inter_token_latency_seconds", "Time between two generated tokens.",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("llmopt:e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("llmopt:request_queue_time_seconds", "Arrival to first scheduled step.",
                                    labels, buckets=E2E_BUCKETS, registry=r)
        # Children exist from the start, so every series is scraped (at 0) before its first event.
        for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage,
                       self.ttft, self.itl, self.e2e, self.queue_time, self.request_timeouts,
                       *self.counters.values()):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        for reason in ("overloaded", "unavailable"):
            self.request_rejected.labels(model_name, reason)
        self.on_queue_time = None  # called with each request's queue time (admission sizes Retry-After by it)
        self._totals: dict[str, float] = {}
        self._tokens_seen: dict[str, int] = {}  # request id -> tokens already observed

    # -- from the engine thread --------------------------------------------------------------
    def record_engine(self, m: dict[str, float]) -> None:
        """Gauges from the engine's state; counters advanced by what changed since last time."""
        name = self.model_name
        self.num_requests_running.labels(name).set(m["num_requests_running"])
        self.num_requests_waiting.labels(name).set(m["num_requests_waiting"])
        self.kv_cache_usage.labels(name).set(m["kv_cache_usage_perc"])
        for key, value in m.items():
            pos, tier = PER_POSITION.match(key), PER_TIER.match(key)
            if key not in self.counters and not pos and not tier:
                continue
            delta = value - self._totals.get(key, 0.0)
            self._totals[key] = value
            if delta > 0:
                counter = (self.accepted_per_position.labels(name, pos.group(1)) if pos
                           else self.offload_hits.labels(name, tier.group(1)) if tier
                           else self.counters[key].labels(name))
                counter.inc(delta)

    def record_outputs(self, outputs) -> None:
        """Latencies of the tokens each request got this step (RequestOutput.metrics)."""
        name = self.model_name
        for out in outputs:
            m, rid = out.metrics, out.request_id
            seen = self._tokens_seen.get(rid, 0)
            times = m.token_times
            if seen == 0 and times:
                self.ttft.labels(name).observe(times[0] - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue_time.labels(name).observe(m.first_scheduled_time - m.arrival_time)
                    if self.on_queue_time is not None:
                        self.on_queue_time(m.first_scheduled_time - m.arrival_time)
            for a, b in zip(times[max(seen - 1, 0):], times[max(seen, 1):]):
                self.itl.labels(name).observe(b - a)
            self._tokens_seen[rid] = len(times)
            if out.finished:
                self.finished(rid, out.outputs[0].finish_reason, m)

    def finished(self, rid: str, reason: str | None, m) -> None:
        self._tokens_seen.pop(rid, None)
        self.request_success.labels(self.model_name, reason or "abort").inc()
        if reason not in ("abort", "error") and m.finished_time is not None:
            self.e2e.labels(self.model_name).observe(m.finished_time - m.arrival_time)

    # -- from the event loop (prometheus_client's metrics are thread-safe) ---------------------
    def rejected(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    def timed_out(self) -> None:
        self.request_timeouts.labels(self.model_name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
