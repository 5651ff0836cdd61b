"""Lesson 11's exercise: a circuit breaker's state machine, closed -> open -> half-open -> closed or open.

The learner writes one step of it: apply an event ("allow": may a request go now?, or how a
request went: "success", "failure", "refused" for a 503) at a time `now` to a breaker held in a
dict with the fields of the engine's `CircuitBreaker`. The check replays event sequences through
that function and through `CircuitBreaker` (on a clock the case sets) and names the first step
where they part. The live run puts the function behind every replica's breaker in
`ResilientClient`: one real `tiny` server on loopback answers, the other replica's port refuses
connections (as a killed replica's does) until a server is started on it. Real servers, not
simulated ones, because what the breaker sees then is what it sees in production (refused
connections, answers), and nginx is not needed: the client talks to the replicas itself. Starting
a `tiny` server takes seconds, so the run starts at most two (one when the lesson lends its live
replica through `url`).
"""

from __future__ import annotations

import threading
import time

from llmopt.bench.resilient_client import CircuitBreaker
from llmopt.exercises.base import Case, Exercise


def breaker_step_solution(
        breaker: dict, event: str, now: float, failure_threshold: int, reset_timeout: float) -> bool | None:
    """Apply `event` at time `now` to `breaker` (state, failures, opened_at, probing), in place.
    For "allow", return whether a request may go now."""
    if event == "allow":
        if breaker["state"] == "open" and now - breaker["opened_at"] >= reset_timeout:
            breaker["state"] = "half_open"        # rested long enough: one request may probe
        if breaker["state"] == "half_open":
            if breaker["probing"]:
                return False                      # the probe is out: the others wait for its answer
            breaker["probing"] = True
            return True
        return breaker["state"] == "closed"
    breaker["probing"] = False                    # whichever request this was, no probe is out now
    if event == "success":
        breaker["state"], breaker["failures"] = "closed", 0
    elif event == "failure":
        breaker["failures"] += 1
        if breaker["state"] == "half_open" or breaker["failures"] >= failure_threshold:
            breaker["state"], breaker["opened_at"] = "open", now
    return None                                   # "refused": a healthy replica's "not now" counts for nothing


def new_breaker() -> dict:
    """A breaker as `CircuitBreaker` starts: closed, no failures."""
    return {"state": "closed", "failures": 0, "opened_at": 0.0, "probing": False}


def _step(t: float, event: str, went, state: str) -> str:
    if event != "allow":
        said = ""
    elif isinstance(went, (bool, int)) and went in (0, 1):   # 1 and 0 read as True and False
        said = "goes, " if went else "held, "
    else:
        said = f"{went!r}, "
    return f"{event}@{t:g}: {said}{state}"


def engine_trace(events: list[tuple[float, str]], failure_threshold: int, reset_timeout: float) -> list[str]:
    """Each step of `events` ((time, event) pairs) through the engine's CircuitBreaker, on a clock
    that reads each event's time."""
    now = [0.0]
    cb = CircuitBreaker(failure_threshold, reset_timeout, clock=lambda: now[0])
    act = {"allow": cb.allow, "success": cb.record_success, "failure": cb.record_failure,
           "refused": cb.record_refused}
    trace = []
    for t, event in events:
        now[0] = t
        trace.append(_step(t, event, act[event](), cb.state))
    return trace


def first_difference(events, yours: list[str], engine: list[str]) -> str | None:
    """None where the two traces agree, else the first step where they part, in words."""
    for i, (t, event) in enumerate(events):
        if yours[i] != engine[i]:
            return (f"step {i + 1} ({event} at t={t:g}) is the first that differs: the engine's breaker "
                    f"'{engine[i]}', yours '{yours[i]}'")
    return None


def replay(fn, events, failure_threshold: int, reset_timeout: float) -> list[str] | str:
    """The learner's trace when it equals the engine's, else the first step that differs, in words."""
    breaker, yours = new_breaker(), []
    for t, event in events:
        went = fn(breaker, event, t, failure_threshold, reset_timeout)
        yours.append(_step(t, event, went if event == "allow" else None, breaker.get("state")))
    engine = engine_trace(events, failure_threshold, reset_timeout)
    return first_difference(events, yours, engine) or yours


def _ask(*times):
    return [(t, "allow") for t in times]


def _fail_at(*times):  # each a request that went and failed
    return [e for t in times for e in ((t, "allow"), (t, "failure"))]


# (note, failure_threshold, reset_timeout, events): times in binary fractions, so that
# "exactly reset_timeout later" is exact in floating point.
CASES = [
    ("failures below the threshold keep it closed", 3, 2.0,
     _fail_at(0.0, 0.25) + _ask(0.5) + [(0.5, "success")] + _ask(0.75)),
    ("the threshold-th failure in a row opens it", 3, 2.0, _fail_at(0.0, 0.25, 0.5) + _ask(0.75, 1.0)),
    ("a success resets the count of failures", 3, 2.0,
     _fail_at(0.0, 0.25) + [(0.5, "allow"), (0.5, "success")] + _fail_at(0.75, 1.0) + _ask(1.25)
     + _fail_at(1.5) + _ask(1.75)),
    ("asked before, and exactly at, reset_timeout after opening", 2, 2.0,
     _fail_at(0.0, 0.5) + _ask(1.0, 2.25, 2.5)),
    ("half-open lets one probe through, and holds the rest", 2, 2.0, _fail_at(0.0, 0.5) + _ask(2.5, 2.5, 3.0)),
    ("the probe fails: open again, and the wait starts over", 2, 2.0,
     _fail_at(0.0, 0.5) + _ask(2.5, 2.75) + [(3.0, "failure")] + _ask(3.5, 4.75, 5.0, 5.0)),
    ("the probe succeeds: closed, every request goes, the count starts from zero", 2, 2.0,
     _fail_at(0.0, 0.5) + _ask(2.5) + [(3.0, "success")] + _ask(3.0, 3.0) + _fail_at(3.25) + _ask(3.5)),
    ("a refused probe (a 503) proves nothing: the next request probes again", 2, 2.0,
     _fail_at(0.0, 0.5) + _ask(2.5, 2.5) + [(2.75, "refused")] + _ask(3.0, 3.0)),
    ("a 503 while closed neither counts as a failure nor resets the count", 2, 2.0,
     _fail_at(0.0) + [(0.25, "allow"), (0.25, "refused")] + _ask(0.5) + _fail_at(0.75) + _ask(1.0)),
    ("a late failure while open (a request sent before it opened) restarts the wait", 2, 2.0,
     _ask(0.0, 0.0) + [(0.25, "failure"), (0.5, "failure"), (1.5, "failure")] + _ask(2.5, 3.5)),
    ("threshold 1: the first failure opens it", 1, 0.5, _fail_at(0.0) + _ask(0.25, 0.5) + [(0.75, "success")]),
]


def cases():
    for note, threshold, timeout, events in CASES:
        yield Case({"events": events, "failure_threshold": threshold, "reset_timeout": timeout},
                   engine_trace(events, threshold, timeout),
                   lambda fn, e=events, n=threshold, r=timeout: replay(fn, e, n, r), note=note)


class PluggedBreaker:
    """A replica's breaker for `ReplicaPool` whose every step is the learner's `fn`; it logs each
    event at its time, so that the engine's CircuitBreaker can replay the same ones afterwards."""

    def __init__(self, fn, failure_threshold: int, reset_timeout: float, clock):
        self.fn, self.failure_threshold, self.reset_timeout, self.clock = fn, failure_threshold, reset_timeout, clock
        self.breaker, self.events, self.trace = new_breaker(), [], []
        self.transitions = [(clock(), "closed")]
        self._lock = threading.Lock()   # the pool may call from several threads, as with the engine's

    @property
    def state(self) -> str:
        return self.breaker["state"]

    def _on(self, event: str):
        with self._lock:
            now, before = self.clock(), self.state
            went = self.fn(self.breaker, event, now, self.failure_threshold, self.reset_timeout)
            self.events.append((now, event))
            self.trace.append(_step(now, event, went if event == "allow" else None, self.state))
            if self.state != before:
                self.transitions.append((now, self.state))
            return went

    def allow(self) -> bool:
        return bool(self._on("allow"))

    def record_success(self) -> None:
        self._on("success")

    def record_failure(self) -> None:
        self._on("failure")

    def record_refused(self) -> None:
        self._on("refused")

    def agreement(self) -> str | None:
        """None where the engine's CircuitBreaker, replaying the same events, decided the same."""
        return first_difference(self.events, self.trace,
                                engine_trace(self.events, self.failure_threshold, self.reset_timeout))


def live(fn, url: str | None = None) -> str:
    """Twelve requests through ResilientClient with `fn` in every breaker: six while replica 1's
    port refuses connections, six after a `tiny` server is started on it; replica 2 is the server
    at `url` (or one started for this)."""
    from llmopt.bench.resilient_client import ResilientClient, RetryPolicy
    from llmopt.server.process import ServerProcess, free_port
    from llmopt.viz import format_table

    args = ["--model", "tiny", "--device", "cpu"]
    servers = [] if url else [ServerProcess(args, threads=1).start()]
    port = free_port()
    names = {f"http://127.0.0.1:{port}": "replica 1", url or servers[0].url: "replica 2"}
    threshold, timeout, t0 = 2, 1.0, time.monotonic()
    client = ResilientClient(list(names), timeout=10, failure_threshold=threshold, reset_timeout=timeout,
                             retry=RetryPolicy(max_retries=3, base_delay=0.05))
    plugged = {u: PluggedBreaker(fn, threshold, timeout, clock=lambda: time.monotonic() - t0) for u in names}
    client.pool.breakers.update(plugged)
    one, log = plugged[next(iter(names))], []

    def send(n: int, phase: str) -> None:
        for _ in range(n):
            r = client.post("/v1/completions", {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4})
            log.append({"phase": phase, "answered": r.ok, "replica 1's breaker after": one.state, "tries": " -> ".join(
                f"{names[a.url]} ({a.status or 'refused'})" for a in r.attempts)})

    try:
        send(6, "replica 1 down")
        started = time.monotonic()
        servers.append(ServerProcess(args, port=port, threads=1).start())
        time.sleep(max(0.0, timeout + 0.1 - (time.monotonic() - started)))   # past reset_timeout: a probe may go
        send(6, "replica 1 started")
    finally:
        client.close()
        for s in servers:
            s.stop()
    steps = sum(len(b.events) for b in plugged.values())
    parted = [f"{names[u]}: {b.agreement()}" for u, b in plugged.items() if b.agreement()]
    path = " -> ".join(s for _, s in one.transitions)
    return (format_table(log) + f"\n\nreplica 1's breaker (your function): {path}\n"
            + (f"your function took all {steps} of the two breakers' steps; the engine's CircuitBreaker, replaying "
               "the same events at the same instants, agrees with every one." if not parted else
               f"your function took the two breakers' {steps} steps; the engine's CircuitBreaker, replaying "
               "them, DIFFERS: " + "; ".join(parted)))


EXERCISE = Exercise("circuit_breaker", 11, "a circuit breaker's step: closed, open, one half-open probe, closed again",
                    cases, breaker_step_solution, live)
