"""Lesson 02's exercise: the slot mapping, `slots_of`, that PagedAttention writes and reads through.

A sequence's block table lists its blocks in order; token position p lives in block
table[p // block_size], at offset p % block_size, so its slot in the flat pool is
block * block_size + offset. The check holds the learner's function against the engine's on
scattered tables and positions that cross block edges; the live run makes the engine's model
runner map every token through it and compares the generated text with the engine's own.
"""

from __future__ import annotations

from llmopt.exercises.base import Case, Exercise
from llmopt.layers.attention import slots_of


def slots_of_solution(block_table: list[int], positions, block_size: int) -> list[int]:
    """The cache slot of each token position of one sequence."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


# (block table, positions, block size): a decode token, a prompt over several blocks out of
# order, a chunk that starts mid-block, block size 1 and a position at the very end of a block.
TABLES = [([3], [2], 4), ([7, 2, 5], range(10), 4), ([0, 9, 4, 1], range(6, 13), 4), ([5, 1], range(2), 1),
          ([2, 8], [15, 16, 31], 16), ([6, 3, 11], [23], 8), ([4, 0, 7, 2], range(3, 16), 4)]


def cases():
    for table, positions, block_size in TABLES:
        positions = list(positions)
        yield Case({"block_table": table, "positions": positions, "block_size": block_size},
                   slots_of(table, positions, block_size),
                   lambda fn, t=table, p=positions, b=block_size: list(fn(list(t), list(p), b)))


def live(fn) -> str:
    """`tiny` on the paged engine with blocks of 8 tokens (so every request spans several), its
    model runner placing each token's keys and values at the slots `fn` gives, against the engine's
    own slots; greedy, so the text must be the same."""
    from llmopt import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", block_size=8, num_kv_blocks=64, enable_prefix_caching=False,
              enforce_eager=True)
    prompts = ["def add(a, b):", "import numpy as np\n", "class Stack:\n    def push"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runner = llm.llm_engine.runner
    runner.slots_of = fn
    try:
        yours = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del runner.slots_of  # back to the class's, the engine's own
    engine = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    lines = [f"{'same' if y == e else 'DIFFERENT'}: {p!r} -> {y!r}" for p, y, e in zip(prompts, yours, engine)]
    verdict = ("the paged engine, writing and reading KV at your slots, generates its own text"
               if yours == engine else "the paged engine with your slots generates other text")
    return "\n".join(lines + [verdict])


EXERCISE = Exercise("slot_mapping", 2, "map a sequence's token positions to cache slots through its block table",
                    cases, slots_of_solution, live)
