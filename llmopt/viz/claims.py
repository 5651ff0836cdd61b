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

# The vector instruction sets llmopt's CPU kernels and torch's pick from, best first, as
# /proc/cpuinfo names them, and as a measurement names them.
ISA = (("amx_bf16", "AMX"), ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"),
       ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"))


def isa(flags: str | None = None) -> str:
    """The vector instruction sets this CPU offers, from its flags (/proc/cpuinfo's by default):
    "AVX512_VNNI, AVX-512, AVX2", or "" where none of those is listed."""
    if flags is None:
        from llmopt.kernels.cpu import cpu_flags

        flags = cpu_flags()
    have = set(flags.replace(":", " ").split())
    return ", ".join(name for flag, name in ISA if flag in have)


def machine() -> str:
    """This machine as a measurement names it: the GPU where torch uses one, else the CPU's model,
    its vector instruction sets and torch's thread count."""
    import torch

    from llmopt.bench.common import cpu_name

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    parts = [cpu_name(), isa(), f"{torch.get_num_threads()} thread{'s' * (torch.get_num_threads() != 1)}"]
    return ", ".join(p for p in parts if p)


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
