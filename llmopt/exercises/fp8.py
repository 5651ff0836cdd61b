"""Lesson 07's exercise: FP8 e4m3 encoding, rounding float32 numbers onto e4m3's 254 finite values.

e4m3 (float8_e4m3fn) keeps 3 mantissa bits: from 2^-6 up, each power-of-two interval holds 8
evenly spaced values (steps of 2^(e-3)); below 2^-6 the subnormals continue in steps of 2^-9
down to 0; the largest value is 448 (no infinity: the format saturates). The learner writes
the rounding without torch's float8 type; the check holds it against the engine's
`quantize_fp8` (clamp, then cast), the live run encodes `tiny`'s weights with it.
"""

from __future__ import annotations

import torch

from llmopt.exercises.base import Case, Exercise
from llmopt.exercises.rtn import weights_perplexity
from llmopt.fp8.format import dequantize_fp8, fp8_values, per_channel_scale, quantize_fp8


def round_to_e4m3_solution(x: torch.Tensor) -> torch.Tensor:
    """Each element of x (float32) rounded to the nearest e4m3 value, ties to even, saturating
    at +-448. Returns float32 values that e4m3 holds exactly."""
    x = x.float()
    a = x.abs().clamp(max=448.0)                     # saturate: the format has no infinity
    _, exponent = torch.frexp(a)                     # a = m * 2^exponent, m in [0.5, 1)
    e = (exponent - 1).clamp(min=-6).float()          # below 2^-6: the subnormals' fixed step
    step = torch.exp2(e - 3)                          # 3 mantissa bits: 8 steps per power of two
    return torch.copysign(torch.round(a / step) * step, x)   # torch.round: ties to even


def _engine(x: torch.Tensor) -> torch.Tensor:
    return quantize_fp8(x, 1.0).float()


def _inputs() -> list[tuple[str, torch.Tensor]]:
    grid = fp8_values()
    positive = grid[grid > 0]
    g = torch.Generator().manual_seed(0)
    return [
        ("every e4m3 value: each must come back unchanged", grid),
        ("halfway between neighbours: ties go to the even mantissa", (positive[1:] + positive[:-1]) / 2),
        ("just above and below halfway", torch.cat([(positive[1:] + positive[:-1]) / 2 * (1 + 1e-4),
                                                    -(positive[1:] + positive[:-1]) / 2 * (1 - 1e-4)])),
        ("ordinary numbers", torch.randn(64, generator=g) * 30),
        ("subnormals (below 2^-6) and below the smallest one",
         torch.tensor([2.0 ** -7, 3 * 2.0 ** -9, 2.0 ** -9, 1.4e-3, 2.0 ** -10, 2.0 ** -11, 1e-6, 0.0, -2.0 ** -8])),
        ("beyond the largest value 448: saturate",
         torch.tensor([448.0, 449.0, 463.9, 464.0, 500.0, 1e4, -1e9, -470.0])),
    ]


def cases():
    for note, x in _inputs():
        yield Case({"x": x}, _engine(x), lambda fn, x=x: fn(x.clone()), note=note)


def live(fn) -> str:
    """Every decoder weight of `tiny` stored as FP8 with one scale per output channel (the
    engine's per_channel_scale), once encoded by the engine's cast and once by `fn`."""
    from llmopt.viz import format_table

    def engine_fp8(w):
        scale = per_channel_scale(w)
        return dequantize_fp8(quantize_fp8(w, scale), scale)

    def yours(w):
        scale = per_channel_scale(w)
        return fn(w / scale) * scale

    rows = [{"tiny's decoder weights": "float32 (as loaded)", "perplexity": weights_perplexity(lambda w: w)},
            {"tiny's decoder weights": "FP8 e4m3 per channel, the engine's cast",
             "perplexity": weights_perplexity(engine_fp8)},
            {"tiny's decoder weights": "FP8 e4m3 per channel, your encoding", "perplexity": weights_perplexity(yours)}]
    return format_table(rows, floatfmt=".3f")


EXERCISE = Exercise("e4m3_rounding", 7, "round float32 numbers to FP8 e4m3, saturating at 448",
                    cases, round_to_e4m3_solution, live)
