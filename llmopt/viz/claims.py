"""Sentences about measurements, printed by the cell that measured them, naming the machine.

A lesson's prose says only what holds on any machine: a formula, a mechanism, what to look
for. What a measurement shows is said by the code that made it, from its numbers, with the
machine it ran on; where the outcome could go either way elsewhere, the code picks the sentence:

    measured(paused_chunked < paused_whole,
             f"chunking cut the decoders' longest pause from {paused_whole:.0f} to {paused_chunked:.0f} ms",
             f"chunking did not shorten the decoders' longest pause ({paused_whole:.0f} -> {paused_chunked:.0f} ms)")

prints "Measured here (AMD EPYC, AVX2, 2 threads): chunking cut the decoders' longest pause ...".
A table made elsewhere is quoted with `quoted`, which says where it was made and where the
learner is.
"""

from __future__ import annotations

from llmopt.bench.common import machine


def measured(holds: bool, sentence: str, otherwise: str) -> str:
    """Print (and return) `sentence` where the measurement bears it out (`holds`), else
    `otherwise`, naming the machine the cell ran on."""
    line = f"Measured here ({machine()}): {sentence if holds else otherwise}"
    print(line)
    return line


def quoted(table: str, where: str) -> str:
    """Print (and return) a committed table a lesson quotes, headed by the machine it was made on
    (`where`, as the table's own header names it) and this one, which may differ."""
    line = f"Quoted from a run on {where}; this notebook runs on {machine()}.\n\n{table}"
    print(line)
    return line
