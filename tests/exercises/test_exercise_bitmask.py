"""Lesson 13's code exercise (the grammar's bitmask on the logits): the check passes its solution
and fails a do-nothing answer, the sign-bit mistake, reversed bits and an in-place mask; the live
run masks with the solution and writes the engine's own valid outputs, and with no mask at all
the engine stops at the first token the grammar refuses.

What every exercise is held to (its solution passes, a do-nothing answer fails) is in
test_exercises.py; here, this one's own mistakes and its live run.
"""

from __future__ import annotations

import pytest
import torch

from llmopt.exercises.bitmask import EXERCISE, pack
from llmopt.structured.bitmask import unpack_bitmask


def _masked(logits, allowed, rows):
    masked = logits.clone()
    masked[rows] = masked[rows].masked_fill(~allowed, float("-inf"))
    return masked


def sign_bit_lost(logits, bitmask, rows):
    """`word & (1 << j) > 0`: in int32, 1 << 31 is negative, and so is a word with bit 31 set."""
    bits = torch.ones(32, dtype=torch.int32) << torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] & bits) > 0).flatten(1)[:, :logits.shape[-1]]
    return _masked(logits, allowed, rows)


def bits_reversed(logits, bitmask, rows):
    bits = 31 - torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    return _masked(logits, allowed, rows)


def masked_in_place(logits, bitmask, rows):
    allowed = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :logits.shape[-1]], float("-inf"))
    return logits


ALMOST_RIGHT = {"token_bitmask": sign_bit_lost}


def test_almost_right_fails_at_bit_31():
    result = EXERCISE.check(ALMOST_RIGHT[EXERCISE.name])
    assert not result and result.answered
    assert "case 2 differs from the engine (bit 31 set" in result.report and "got:" in result.report


@pytest.mark.parametrize("wrong", [bits_reversed, masked_in_place])
def test_other_mistakes_fail(wrong):
    result = EXERCISE.check(wrong)
    assert not result and result.answered and "differs from the engine" in result.report


def test_pack_is_the_layout_the_engine_unpacks():
    allowed = [[0, 31, 32, 63, 69], [5]]
    bitmask = pack(allowed, 70, padding=True)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (2, 3) and int(bitmask[0, 0]) < 0
    got = unpack_bitmask(bitmask, 70)
    assert [r.nonzero().flatten().tolist() for r in got] == [[0, 31, 32, 63, 69], [5]]


def test_the_engine_masks_with_the_plugged_in_function(one_thread):
    report = EXERCISE.live(EXERCISE.solution)
    assert "DIFFERENT" not in report and "NOT VALID" not in report
    assert report.endswith("each valid under its constraint")
    # no mask at all: the model's own choice leaves the grammar, and the engine stops there
    assert "DIFFERENT: the engine stopped" in EXERCISE.live(lambda logits, bitmask, rows: logits)
