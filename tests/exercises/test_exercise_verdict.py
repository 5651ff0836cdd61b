"""Lesson 15's claim-verdict exercise: the check passes the solution and fails a rule that ignores
which side of the bound is better; the live run re-scores a scorecard with the learner's rule.

What every exercise is held to (its solution passes, a do-nothing answer fails) is in
test_exercises.py; here, this one's own mistakes and its live run.
"""

from __future__ import annotations

from llmopt.exercises.verdict import EXERCISE, claim_verdict_solution, committed_card, live
from llmopt.viz.scorecard import Scorecard


def direction_ignored(tests, refutable=True):
    """Right except that every test reads as "higher is better"."""
    missing = False
    for measured, _op, bound in tests:
        if measured is None:
            missing = True
        elif not measured >= bound:
            return "does not hold" if refutable else "needs a GPU"
    return "needs a GPU" if missing else "holds"


def boundary_on_the_wrong_side(tests, refutable=True):
    """Right except that the bound itself passes > and < and fails >= and <=."""
    swapped = {">=": ">", ">": ">=", "<=": "<", "<": "<="}
    return claim_verdict_solution([(m, swapped[op], b) for m, op, b in tests], refutable)


def missing_before_failing(tests, refutable=True):
    """Right except that a missing measurement wins over a failing test."""
    if any(m is None for m, _, _ in tests):
        return "needs a GPU"
    return claim_verdict_solution(tests, refutable)


ALMOST_RIGHT = {"claim_verdict": direction_ignored}


def test_almost_right_answers_fail_at_their_case():
    result = EXERCISE.check(ALMOST_RIGHT["claim_verdict"])
    assert not result and "differs from the engine" in result.report
    assert "INT8" in result.report and "expected: 'holds'" in result.report   # its loss is under the bound
    result = EXERCISE.check(boundary_on_the_wrong_side)
    assert not result and "differs from the engine (higher is better, at the bound" in result.report
    result = EXERCISE.check(missing_before_failing)
    assert not result and "(a test fails beside a missing one" in result.report


def test_live_run_rescores_the_scorecard_with_the_learners_rule():
    ok = live(claim_verdict_solution)
    assert "re-scored the scorecard's 9 claims: every verdict equals the engine's." in ok and "DIFFERS" not in ok
    assert "NF4: -75% memory, small loss" in ok
    wrong = live(direction_ignored)
    assert "DIFFER from the engine's" in wrong


def test_live_run_takes_the_lessons_card(capsys):
    card = Scorecard()
    card.score("a", [(1.0, ">=", 2.0)], "x1", "why", refutable=False)
    card.score("b", True, "x1", "decided by its cell")
    report = live(lambda tests, refutable=True: "needs a GPU", card=card)
    assert "re-scored the scorecard's 1 claims (1 rows scored without tests left out): every verdict" in report
    assert len(committed_card().rows) == 9
