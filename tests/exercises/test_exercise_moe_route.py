"""Lesson 10's exercise: DeepSeek-V3's top-k expert routing. The solution passes; a do-nothing
answer and one that forgets to normalise the chosen weights fail; the live run, every MoE layer of
the lesson's model routed by the solution, gives the engine's own greedy tokens.

What every exercise is held to (its solution passes, a do-nothing answer fails) is in
test_exercises.py; here, this one's own mistakes and its live run.
"""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from llmopt import model_path
from llmopt.exercises.moe_route import EXERCISE, route_solution
from llmopt.layers import moe
from llmopt.viz.frontier import write_zoo


def route_without_normalising(logits, bias, cfg):
    """Right, except that norm_topk_prob is ignored: the weights are the raw scores, scaled."""
    return route_solution(logits, bias, dataclasses.replace(cfg, norm_topk_prob=False))


ALMOST_RIGHT = {EXERCISE.name: route_without_normalising}


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py: one torch thread, as the lesson runs


def test_almost_right_fails_where_weights_are_normalised():
    result = EXERCISE.check(ALMOST_RIGHT[EXERCISE.name])
    assert not result and result.answered
    assert "differs from the engine" in result.report and "case 2" in result.report


def test_order_of_a_tokens_experts_does_not_matter():
    def descending_ids(logits, bias, cfg):
        ids, weights = route_solution(logits, bias, cfg)
        order = ids.argsort(dim=-1, descending=True)
        return ids.gather(-1, order), weights.gather(-1, order)
    assert EXERCISE.check(descending_ids)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    transformers.utils.logging.disable_progress_bar()
    return write_zoo(tmp_path_factory.mktemp("zoo"), model_path("tiny"), names=["MLA"])["MLA"]


def test_live_run_gives_the_engines_tokens_and_puts_route_back(folder):
    engine_route = moe.route
    report = EXERCISE.run_live(route_solution, folder=folder)
    assert moe.route is engine_route
    assert "DIFFERENT" not in report and report.endswith("greedy tokens equal to the engine's own routing")
    wrong = EXERCISE.live(route_without_normalising, folder=folder)
    assert moe.route is engine_route
    assert "DIFFERENT" in wrong and wrong.endswith("differ from the engine's own routing")
