"""Client-side degradation against real replicas: the backoff's arithmetic, the breaker's states
on a clock the test turns, and then two `llmopt serve` replicas, one of which is killed and
later restarted on its port: the client keeps answering from the other, stops sending to the
dead one, probes it half-open, and takes it back once it answers. The official `openai`
client gets the same breaker through `call_with_breaker`.
"""

from __future__ import annotations

import random
import signal
import time

import openai
import pytest

from llmopt.bench.resilient_client import (
    CircuitBreaker,
    NoReplicaAvailable,
    ReplicaPool,
    ResilientClient,
    RetryPolicy,
    call_with_breaker,
)
from llmopt.server.process import ServerProcess, free_port, start_all

ARGS = ["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "64", "--max-num-seqs", "4"]
BODY = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}


def test_backoff_honours_retry_after_and_grows_with_jitter():
    policy, rng = RetryPolicy(base_delay=0.5, max_delay=8.0, jitter=0.5), random.Random(0)
    waits = [policy.delay(0, "3", rng) for _ in range(200)]
    assert all(3.0 <= w <= 4.5 for w in waits) and len(set(waits)) > 100  # never sooner; spread out
    for attempt, base in enumerate([0.5, 1.0, 2.0, 4.0, 8.0, 8.0]):
        w = [policy.delay(attempt, None, rng) for _ in range(200)]
        assert base <= min(w) and max(w) <= base * 1.5
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="reset_timeout"):
        CircuitBreaker(reset_timeout=0)


def test_breaker_opens_probes_half_open_and_closes():
    now = [0.0]
    b = CircuitBreaker(failure_threshold=2, reset_timeout=5.0, clock=lambda: now[0])
    assert b.allow()
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and not b.allow()
    now[0] = 4.9
    assert not b.allow()
    now[0] = 5.0
    assert b.allow() and b.state == "half_open"   # the probe
    assert not b.allow()                           # one probe at a time
    b.record_failure()                             # the probe failed: open again, for another 5 s
    assert b.state == "open" and not b.allow()
    now[0] = 10.0
    assert b.allow()
    b.record_success()
    assert b.state == "closed" and b.allow() and b.allow()
    assert [s for _, s in b.transitions] == ["closed", "open", "half_open", "open", "half_open", "closed"]


@pytest.fixture(scope="module")
def two_replicas():
    servers = start_all([ServerProcess(ARGS) for _ in range(2)])
    yield servers
    for s in servers:
        s.stop(signal.SIGKILL)


def test_a_failing_replica_is_cut_off_probed_and_taken_back(two_replicas):
    healthy, victim = two_replicas
    client = ResilientClient([healthy.url, victim.url], timeout=10, failure_threshold=2, reset_timeout=1.0,
                             retry=RetryPolicy(max_retries=3, base_delay=0.05))
    before = [client.post("/v1/completions", BODY) for _ in range(4)]
    assert all(r.ok for r in before) and {r.attempts[0].url for r in before} == {healthy.url, victim.url}

    victim.stop(signal.SIGKILL)
    during = [client.post("/v1/completions", BODY) for _ in range(12)]
    assert all(r.ok and r.attempts[-1].url == healthy.url for r in during), [r.error for r in during]
    sent_to_dead = [a for r in during for a in r.attempts if a.url == victim.url]
    assert all(a.status is None for a in sent_to_dead)  # refused connections
    assert 2 <= len(sent_to_dead) < 12  # opened after two failures; then only the odd half-open probe
    assert client.pool.breakers[victim.url].state in ("open", "half_open")

    restarted = ServerProcess(ARGS, port=victim.port).start()
    try:
        time.sleep(1.1)  # past reset_timeout: the next request to it is a probe
        after = [client.post("/v1/completions", BODY) for _ in range(6)]
        assert all(r.ok for r in after)
        assert any(a.url == victim.url and a.status == 200 for r in after for a in r.attempts)
        states = [s for _, s in client.pool.breakers[victim.url].transitions]
        assert states[:2] == ["closed", "open"] and "half_open" in states and states[-1] == "closed", states
    finally:
        restarted.stop(signal.SIGKILL)
        client.close()


def test_every_replica_down_fails_fast_with_a_clear_error():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    client = ResilientClient(dead, timeout=2, failure_threshold=1, reset_timeout=60,
                             retry=RetryPolicy(max_retries=3, base_delay=0.01))
    r = client.post("/v1/completions", BODY)
    assert not r.ok and "circuit breaker is open" in r.error
    assert len(r.attempts) == 2  # one try on each, then nothing is sent to either
    client.close()


def test_the_openai_client_behind_the_breaker(two_replicas):
    """The README's pattern: one openai.OpenAI per replica with its own timeout and max_retries,
    a ReplicaPool choosing among them."""
    healthy = two_replicas[0]
    dead = f"http://127.0.0.1:{free_port()}"
    pool = ReplicaPool([healthy.url, dead], failure_threshold=1, reset_timeout=60)
    clients = {u: openai.OpenAI(base_url=f"{u}/v1", api_key="none", timeout=5, max_retries=0) for u in pool.urls}
    answers, errors = [], 0
    for _ in range(6):
        try:
            answers.append(call_with_breaker(pool, clients, lambda c: c.completions.create(**BODY)))
        except openai.APIConnectionError:
            errors += 1  # the dead one, once: then its breaker is open
    assert errors == 1 and len(answers) == 5 and all(a.choices[0].text for a in answers)
    pool2 = ReplicaPool([dead], failure_threshold=1, reset_timeout=60)
    with pytest.raises(openai.APIConnectionError):
        call_with_breaker(pool2, {dead: clients[dead]}, lambda c: c.completions.create(**BODY))
    with pytest.raises(NoReplicaAvailable):
        call_with_breaker(pool2, {dead: clients[dead]}, lambda c: c.completions.create(**BODY))
