"""A short soak with faults behind the real nginx (the long one is benchmarks/soak.py): two tiny
replicas, one speculative, under Poisson load for 30 s while one is killed and restarted, the
other drained and restarted, a client stalls, and an oversized and a malformed body arrive.

Every request must end answered in full, refused with 503 + Retry-After after its retries, or,
for a stream that had started on the killed replica, with an error its client saw. Nothing is
lost silently, every 503 carries Retry-After, and no replica holds a KV block afterwards.
"""

from __future__ import annotations

import pytest
from test_deploy import need

from llmopt.bench.soak import Fault, Soak
from llmopt.server.nginx import find_nginx

BASE = ["--model", "tiny", "--device", "cpu", "--num-kv-blocks", "256", "--max-num-seqs", "6",
        "--max-waiting-requests", "6", "--shutdown-timeout", "60"]
SPEC = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']


@pytest.fixture(scope="module")
def soak():
    need(find_nginx(), "nginx", "nginx")
    # The clients retry a refusal up to 16 times, Retry-After apart (1-5 s each), to outlast a
    # replica's restart on a loaded machine (with 8, a CI run with a lesson beside it refused 18 of 91).
    run = Soak([BASE, BASE + SPEC], rate=3.0, duration=30.0, seed=1, max_retries=16,
               faults=[Fault(6.0, "kill", 0), Fault(8.0, "stall"), Fault(10.0, "oversized"),
                       Fault(11.0, "malformed"), Fault(16.0, "drain", 1)])
    return run.run()


def test_nothing_is_lost_silently(soak):
    assert soak["requests"] > 50
    assert soak["lost_silently"] == 0, soak["errors"]
    unanswered = soak["requests"] - soak["answered"]
    # the only requests allowed to fail: streams cut by the kill, and refusals after every retry
    assert unanswered == soak["cut"] + soak["refused_503"], soak["errors"]
    assert soak["cut"] <= 6  # at most the killed replica's running streams
    # How many a pair of replicas answers depends on the CPU they share: alone on 2 cores 90 of 91,
    # beside four busy processes 72 (a refusal past that is the designed answer to overload, counted
    # exactly above). A pair that failed over badly would lose most of the 58 of 91 requests sent
    # while one replica was away, which this floor catches on any machine.
    assert soak["answered"] >= 0.6 * soak["requests"]


def test_every_refusal_is_a_503_with_retry_after(soak):
    assert soak["answers_503_without_retry_after"] == 0
    assert {p["kind"]: p["status"] for p in soak["probes"]} == {"oversized": 413, "malformed": 400}


def test_the_faults_happened_and_no_kv_block_leaked(soak):
    kinds = {e["kind"]: e for e in soak["events"]}
    assert kinds["kill"]["exit_code"] == -9 and kinds["drain"]["exit_code"] == 0  # drained cleanly
    assert "stall" in kinds
    # the load went on while each replica was away, and was carried by the other (whether a
    # client also had to retry depends on how fast this machine is, so it is not asserted)
    for fault in (kinds["kill"], kinds["drain"]):
        assert fault["sent_while_down"] > 0 and fault["answered_while_down"] > 0, fault
    assert soak["leaked_kv"] == [], soak["final"]
    assert all(f["running"] == 0 and f["waiting"] == 0 for f in soak["final"]), soak["final"]
