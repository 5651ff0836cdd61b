"""Lesson 14's exercise: KIVI's per-channel int4 keys, held against the engine's own write.

What every exercise is held to (its solution passes, a do-nothing answer fails) is in
test_exercises.py; here, this one's own mistakes and its live run.
"""

import torch

from llmopt.exercises.int_kv import EXERCISE, quantize_keys_solution


def keys_on_unrounded_grid(k):
    """Right except that the codes are taken on the float32 scale and minimum, not on the float16
    ones the pool keeps (a few codes land one step off)."""
    lo, hi = k.amin(0), k.amax(0)
    s, m = (hi - lo) / 15, lo
    q = torch.round((k - m) / torch.where(s > 0, s, 1.0)).clamp(0, 15)
    return torch.where(s > 0, q, 0.0).to(torch.uint8), torch.stack((s, m), -1).half()


def keys_per_token(k):
    """KIVI's grouping turned around: one group per token over its channels (the values' way)."""
    lo, hi = k.amin(-1, keepdim=True), k.amax(-1, keepdim=True)
    group = torch.stack(((hi - lo) / 15, lo), -1).half()
    s, m = group[..., 0].float(), group[..., 1].float()
    q = torch.round((k - m) / torch.where(s > 0, s, 1.0)).clamp(0, 15)
    return q.to(torch.uint8), group[:, :, 0].transpose(0, 1).contiguous()


ALMOST_RIGHT = {"int4_keys_per_channel": keys_on_unrounded_grid}


def test_the_grid_the_pool_keeps_is_the_one_codes_are_taken_on():
    result = EXERCISE.check(keys_on_unrounded_grid)
    assert not result and "item 0 differs first" in result.report, result.report
    result = EXERCISE.check(keys_per_token)
    assert not result and "case 1 differs" in result.report, result.report


def test_the_engine_stores_keys_the_learners_function_quantized():
    report = EXERCISE.live(quantize_keys_solution, model="tiny")
    assert "your keys give the engine's own int4 tokens" in report, report
    blocks = int(report.split("blocks of keys your function quantized: ")[1].split("\n")[0])
    assert blocks > 0
    # codes that ignore the keys (every one at its channel's minimum) change what the engine generates
    report = EXERCISE.live(lambda k: (torch.zeros_like(k, dtype=torch.uint8), quantize_keys_solution(k)[1]),
                           model="tiny")
    assert "DIFFERENT" in report, report
