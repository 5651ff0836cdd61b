"""Lesson 09's exercise: a TP rank's slice of a linear's weight. The solution passes and is the
slice `shard_llama` cuts; a do-nothing answer and the remainder-on-the-last-rank split fail; the
live run, TP 2 in one process from the solution's shards, gives the unsharded engine's tokens.

What every exercise is held to (its solution passes, a do-nothing answer fails) is in
test_exercises.py; here, this one's own mistakes and its live run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llmopt import model_path
from llmopt.distributed.sharding import shard_llama
from llmopt.exercises.tp_shard import EXERCISE, shard_linear_solution
from llmopt.model.loader import load_model


def remainder_on_last_rank(weight, tp, rank, parallel):
    """Right where the size divides; otherwise every rank gets n // tp and the last one the rest."""
    dim = 0 if parallel == "column" else 1
    n = weight.shape[dim]
    lo = rank * (n // tp)
    hi = n if rank == tp - 1 else lo + n // tp
    return weight.narrow(dim, lo, hi - lo)


ALMOST_RIGHT = {EXERCISE.name: remainder_on_last_rank}


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py: one torch thread, as the lesson runs


def test_almost_right_fails_on_an_uneven_split():
    result = EXERCISE.check(ALMOST_RIGHT[EXERCISE.name])
    assert not result and result.answered
    assert "differs from the engine" in result.report and "the first ranks larger" in result.report
    # splitting the rows for a row-parallel weight fails too
    rows_always = EXERCISE.check(lambda w, tp, r, p: shard_linear_solution(w, tp, r, "column"))
    assert not rows_always and "row-parallel: the input columns" in rows_always.report


def test_solution_cuts_what_shard_llama_cuts():
    full = load_model(model_path("tiny"))
    for rank in range(2):
        model = copy.deepcopy(full)
        shard_llama(model, 2, rank, group=None)   # the group is only used in forward
        for whole, cut in zip(full.model.layers, model.model.layers):
            gate, up = whole.mlp.gate_up_proj.weight.chunk(2)
            mine = [shard_linear_solution(w, 2, rank, "column") for w in (gate, up)]
            assert torch.equal(cut.mlp.gate_up_proj.weight, torch.cat(mine))
            assert torch.equal(cut.mlp.down_proj.weight, shard_linear_solution(whole.mlp.down_proj.weight, 2, rank, "row"))
            assert torch.equal(cut.self_attn.o_proj.weight,
                               shard_linear_solution(whole.self_attn.o_proj.weight, 2, rank, "row"))


def test_live_run_gives_the_unsharded_tokens_and_counts_the_all_reduce_bytes():
    report = EXERCISE.run_live(shard_linear_solution)
    assert "ranks run one after another" in report and "DIFFERENT" not in report
    assert report.endswith("greedy tokens equal to the unsharded engine's")
    assert "18,432 per token (formula 2 x 6 layers x 384 x 4 bytes = 18,432)" in report
    # rank r's gate and up rows paired with rank r + 1's down columns: shapes fit, the sum is wrong
    mismatched = EXERCISE.live(lambda w, tp, r, p: shard_linear_solution(w, tp, (r + (p == "column")) % tp, p))
    assert "DIFFERENT" in mismatched and mismatched.endswith("differ from the unsharded engine's")
