"""Lesson 01's exercise: the KV cache's write, `ContiguousKVCache.store`.

The learner writes where a step's new keys and values go in a contiguous cache: sequence i's
query_lens[i] new tokens land in its strip `slots[i]`, right after its context_lens[i] cached
ones. The check holds it against the engine's own store on prefill and decode steps; the live
run generates with a cache that stores through it and compares with the no-cache loop.
"""

from __future__ import annotations

import functools

import torch

from llmopt.engine.reference_loops import generate_naive, generate_with_cache
from llmopt.exercises.base import Case, Exercise
from llmopt.layers.attention import AttentionMetadata
from llmopt.worker.kv_cache import ContiguousKVCache


def store_kv_solution(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      slots: list[int], context_lens: list[int], query_lens: list[int]) -> None:
    """k_cache, v_cache [max_seqs, Hkv, max_len, D]; k, v [num_tokens, Hkv, D], the step's tokens
    of all sequences one after another. Writes them in place."""
    start = 0
    for slot, c, n in zip(slots, context_lens, query_lens):
        k_cache[slot, :, c:c + n] = k[start:start + n].transpose(0, 1)
        v_cache[slot, :, c:c + n] = v[start:start + n].transpose(0, 1)
        start += n


# (slots, context_lens, query_lens) of the steps tried: prefills, a chunk after cached tokens,
# decodes of several sequences in strips out of order, and a step that fills a strip to its end.
STEPS = [([0], [0], [5]), ([2, 0], [0, 0], [3, 4]), ([1], [4], [3]), ([0, 1, 2], [5, 7, 1], [1, 1, 1]),
         ([2, 0], [6, 2], [1, 4]), ([1], [0], [8])]
MAX_SEQS, HEADS, MAX_LEN, DIM = 3, 2, 8, 4


def _case(slots, context_lens, query_lens, seed) -> Case:
    g = torch.Generator().manual_seed(seed)
    before = torch.randn(2, MAX_SEQS, HEADS, MAX_LEN, DIM, generator=g)   # whatever the strips held
    k, v = torch.randn(2, sum(query_lens), HEADS, DIM, generator=g)
    cache = ContiguousKVCache(1, MAX_SEQS, MAX_LEN, HEADS, DIM)
    cache.k[0].copy_(before[0])
    cache.v[0].copy_(before[1])
    for s, c in zip(slots, context_lens):
        cache.lens[s] = c   # what each strip already holds, as begin_step checks
    meta = AttentionMetadata.contiguous(slots, context_lens, query_lens)
    cache.begin_step(meta)
    cache.store(0, k, v, meta)

    def call(fn):
        kc, vc = before[0].clone(), before[1].clone()
        fn(kc, vc, k.clone(), v.clone(), list(slots), list(context_lens), list(query_lens))
        return [kc, vc]

    return Case({"slots": slots, "context_lens": context_lens, "query_lens": query_lens,
                 "k_cache, v_cache": f"[{MAX_SEQS}, {HEADS}, {MAX_LEN}, {DIM}] each", "k": k},
                [cache.k[0], cache.v[0]], call, note="the caches after your write: [k_cache, v_cache]")


def cases():
    for i, (slots, c, n) in enumerate(STEPS):
        yield _case(slots, c, n, seed=i)


class LearnerKVCache(ContiguousKVCache):
    """The engine's contiguous cache with the learner's write in place of its own."""

    def __init__(self, store_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store_fn = store_fn

    def store(self, layer, k, v, meta):
        self.store_fn(self.k[layer], self.v[layer], k, v, meta.slots, meta.context_lens, meta.query_lens)


def live(fn) -> str:
    """Greedy generation on `tiny` through the KV-cache loop, storing with `fn`, against the naive
    loop (no cache at all): the cache must change the speed, never the tokens."""
    from llmopt import LLM, SamplingParams
    from llmopt.sequence import Sequence

    llm = LLM("tiny", device="cpu", enforce_eager=True)
    model, tok = llm.llm_engine.model, llm.tokenizer
    prompts = ["def add(a, b):", "import numpy as np\n", "class Stack:\n    def push"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(loop, **kw):
        seqs = [Sequence(str(i), p, tok(p)["input_ids"], params) for i, p in enumerate(prompts)]
        loop(model, seqs, eos_token_ids=llm.eos_token_ids, max_model_len=llm.max_model_len, **kw)
        return [s.output_token_ids for s in seqs]

    yours = run(generate_with_cache, make_cache=functools.partial(LearnerKVCache, fn))
    naive = run(generate_naive)
    lines = [f"{'same' if y == n else 'DIFFERENT'}: {p!r} -> {tok.decode(y)!r}"
             for p, y, n in zip(prompts, yours, naive)]
    verdict = "your store_kv, inside the KV-cache loop, generates the no-cache loop's tokens" if yours == naive \
        else "the KV-cache loop with your store_kv does not generate the no-cache loop's tokens"
    return "\n".join(lines + [verdict])


EXERCISE = Exercise("contiguous_kv_store", 1, "write a step's keys and values into a contiguous KV cache",
                    cases, store_kv_solution, live)
