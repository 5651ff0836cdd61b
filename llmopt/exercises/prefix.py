"""Lesson 04's exercise: a request's chained block hashes, the keys of vLLM's prefix cache.

Block i's hash covers its own `block_size` tokens and, through the hash of block i - 1, every
token before them: two requests share block i's hash only if they agree on everything up to its
end. Only full blocks are hashed (a partial block's tokens are still changing). The check holds
the learner's hashes against those the engine's BlockManager records for the same tokens; the
live run looks the learner's hashes up in a running engine's prefix cache.
"""

from __future__ import annotations

from llmopt.engine.block_manager import BlockManager, hash_block
from llmopt.exercises.base import Case, Exercise


def block_hashes_solution(token_ids: list[int], block_size: int) -> list[int]:
    """One hash per full block of `token_ids`, each chained on the one before (`hash_block`)."""
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


def engine_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hashes the engine's BlockManager registers once all of `token_ids` are computed."""
    bm = BlockManager(num_blocks=64, block_size=block_size)
    bm.allocate("seq", len(token_ids))
    bm.cache_full_blocks("seq", token_ids, len(token_ids))
    return bm.block_hashes["seq"]


# Token lists tried: two that share a first block and then part, the same block after different
# prefixes (a block repeated: its hash must still differ), a partial last block, one token short.
TOKENS = [(list(range(8)), 4), (list(range(8)) + [99, 98, 97, 96], 4), ([5, 5, 5, 5] * 3, 4),
          ([1, 2, 3, 4, 1, 2, 3, 4], 4), (list(range(10)), 4), (list(range(15)), 16), (list(range(50, 82)), 16),
          ([7, 1, 2, 3, 4, 5, 6, 8], 2)]


def cases():
    for tokens, block_size in TOKENS:
        yield Case({"token_ids": tokens, "block_size": block_size}, engine_block_hashes(tokens, block_size),
                   lambda fn, t=tokens, b=block_size: list(fn(list(t), b)))


def live(fn) -> str:
    """A running `tiny` engine serves one request with a long shared beginning; then `fn` hashes a
    second request that shares that beginning and each of its hashes is looked up in the engine's
    prefix cache: the blocks found are the prefix the engine would not recompute."""
    from llmopt import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", block_size=16, enforce_eager=True)
    bm = llm.llm_engine.block_manager
    shared = llm.tokenizer("You are a careful Python reviewer. Answer in one sentence. " * 3)["input_ids"]
    first = shared + llm.tokenizer("Is `x == None` fine?")["input_ids"]
    second = shared + llm.tokenizer("Why use a set here?")["input_ids"]
    llm.generate({"prompt_token_ids": first}, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    found = 0
    for h in fn(second, bm.block_size):
        if h not in bm.cached:
            break
        found += 1
    engine = bm.cached_prefix_len(second) // bm.block_size
    return (f"{len(shared)} shared tokens = {len(shared) // bm.block_size} full blocks of {bm.block_size}; the second "
            f"request's {len(second)} tokens: your hashes find {found} block(s) in the live prefix cache, "
            f"the engine's lookup finds {engine}" + (" (the same)" if found == engine else ""))


EXERCISE = Exercise("chained_block_hashes", 4, "hash a request's full blocks, each chained on the one before",
                    cases, block_hashes_solution, live)
