"""Lesson 11's circuit-breaker exercise: the check passes the solution and names the step where a
wrong breaker parts from the engine's CircuitBreaker; the live run drives the resilient client
with the learner's function against a real `tiny` server and a replica that comes back.

What every exercise is held to (its solution passes, a do-nothing answer fails) is in
test_exercises.py; here, this one's own mistakes and its live run.
"""

from __future__ import annotations

from llmopt.exercises.breaker import EXERCISE, PluggedBreaker, breaker_step_solution


def half_open_lets_all_through(breaker, event, now, failure_threshold, reset_timeout):
    """Right except that half-open sends every request, not one probe."""
    went = breaker_step_solution(breaker, event, now, failure_threshold, reset_timeout)
    return True if event == "allow" and breaker["state"] == "half_open" else went


def count_not_reset(breaker, event, now, failure_threshold, reset_timeout):
    """Right except that a success closes the breaker without clearing its count of failures."""
    if event == "success":
        breaker["probing"], breaker["state"] = False, "closed"
        return None
    return breaker_step_solution(breaker, event, now, failure_threshold, reset_timeout)


ALMOST_RIGHT = {"circuit_breaker": half_open_lets_all_through}


def test_almost_right_answers_fail_naming_the_step():
    result = EXERCISE.check(ALMOST_RIGHT["circuit_breaker"])
    assert not result and "differs from the engine" in result.report
    assert "(half-open lets one probe through" in result.report
    assert "step 6 (allow at t=2.5) is the first that differs" in result.report
    assert "'allow@2.5: held, half_open', yours 'allow@2.5: goes, half_open'" in result.report
    result = EXERCISE.check(count_not_reset)
    assert not result and "differs from the engine" in result.report
    assert "(a success resets the count of failures)" in result.report


def test_plugged_breaker_is_replayed_through_the_engine():
    now = [0.0]
    for fn, agrees in ((breaker_step_solution, True), (half_open_lets_all_through, False)):
        b = PluggedBreaker(fn, 1, 1.0, clock=lambda: now[0])
        for t, step in ((0.0, b.allow), (0.0, b.record_failure), (1.0, b.allow), (1.0, b.allow)):
            now[0] = t
            step()
        assert (b.agreement() is None) == agrees, b.agreement()
    assert "step 4 (allow at t=1)" in b.agreement()


def test_live_run_uses_the_learners_breaker_and_agrees():
    report = EXERCISE.live(breaker_step_solution)
    assert "replica 1's breaker (your function): closed -> open -> half_open -> closed" in report, report
    assert "agrees with every one" in report and "DIFFERS" not in report, report
    assert "replica 1 (refused) -> replica 2 (200)" in report and "replica 1 (200)" in report, report
