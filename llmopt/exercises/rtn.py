"""Lesson 06's exercise: group-wise round-to-nearest (RTN), the grid GPTQ and AWQ share.

The learner quantizes a weight [out, in] group by group (`group_size` consecutive input
columns of one row) onto 2^bits levels with a scale and a zero point, and returns the weights
as they come back (dequantized). The check holds that against the engine's `fake_quantize`; the
live run quantizes every linear of `tiny` with it and measures perplexity beside the engine's RTN.
"""

from __future__ import annotations

import torch

from llmopt.exercises.base import Case, Exercise
from llmopt.quant.rtn import fake_quantize


def rtn_solution(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Asymmetric group-wise RTN of w [out, in] (group_size -1: one group per row), dequantized."""
    out, k = w.shape
    g = k if group_size == -1 else group_size
    groups = w.float().reshape(out, k // g, g)
    maxq = 2 ** bits - 1
    lo = groups.amin(-1, keepdim=True).clamp(max=0)     # the grid must hold 0 exactly
    hi = groups.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / maxq).half().float()            # stored as float16, as checkpoints do
    scale = torch.where(scale == 0, 1.0, scale)          # an all-zero group: any scale gives zeros
    zero = torch.round(-lo / scale).clamp(0, maxq)
    q = torch.clamp(torch.round(groups / scale) + zero, 0, maxq)
    return (scale * (q - zero)).reshape(out, k).to(w.dtype)


def _weights(seed: int, shape: tuple[int, int], kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    if kind == "outliers":        # a few large weights: they stretch their group's scale
        w[0, 3], w[2, 40] = 0.9, -1.3
    elif kind == "one-signed":    # rows all positive / all negative: 0 still has to be on the grid
        w[0] = w[0].abs() + 0.01
        w[1] = -w[1].abs() - 0.02
    elif kind == "zero group":    # a pruned group, all zeros
        w[1, :16] = 0.0
    return w


# (seed, shape, bits, group_size, kind)
CASES = [(0, (4, 64), 4, 32, "plain"), (1, (4, 64), 4, 32, "one-signed"), (2, (6, 64), 4, 16, "outliers"),
         (3, (4, 96), 3, 32, "plain"), (4, (4, 64), 8, -1, "plain"), (5, (3, 64), 2, 16, "one-signed"),
         (6, (4, 64), 4, 16, "zero group"), (7, (8, 128), 4, 128, "outliers")]


def cases():
    for seed, shape, bits, group_size, kind in CASES:
        w = _weights(seed, shape, kind)
        yield Case({"w": w, "bits": bits, "group_size": group_size}, fake_quantize(w, bits, group_size, sym=False),
                   lambda fn, w=w, b=bits, g=group_size: fn(w.clone(), b, g), note=f"{kind} weights")


def weights_perplexity(transform, max_tokens: int = 1024) -> float:
    """Perplexity of `tiny` on held-out text with every decoder linear's weight replaced by
    transform(weight): the measurement both quantization exercises' live runs make."""
    from llmopt import LLM
    from llmopt.eval import perplexity

    llm = LLM("tiny", device="cpu", enforce_eager=True)
    with torch.no_grad():
        for name, m in llm.llm_engine.model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}":
                m.weight.copy_(transform(m.weight.detach().clone()))
    return perplexity(llm, max_tokens=max_tokens)


def live(fn) -> str:
    from llmopt.viz import format_table

    rows = [{"tiny's decoder weights": "float32 (as loaded)", "perplexity": weights_perplexity(lambda w: w)},
            {"tiny's decoder weights": "engine's RTN, 4 bits, groups of 32",
             "perplexity": weights_perplexity(lambda w: fake_quantize(w, 4, 32, sym=False))},
            {"tiny's decoder weights": "your RTN, 4 bits, groups of 32",
             "perplexity": weights_perplexity(lambda w: fn(w, 4, 32))}]
    return format_table(rows, floatfmt=".3f")


EXERCISE = Exercise("groupwise_rtn", 6, "round weights to a 2^bits-level grid per group, with a scale and a zero point",
                    cases, rtn_solution, live)
