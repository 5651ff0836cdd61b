"""Multi-turn conversations, one request at a time: time to first token per turn, and where each
turn's prompt came from (the pool's prefix cache, a tier below it, or computed).

A returning turn's prompt is the conversation so far (every earlier user message and answer) plus
a new message, so all but the new message was computed before; whether it is computed again
depends on whether its blocks are still in the pool, in the offload tier, or gone. Conversations
are served round robin (every conversation's turn 1, then every turn 2, ...), so that between
two turns of one conversation all the others pass through the pool.
"""

from __future__ import annotations

import random
import time

from llmopt.bench.inputs import cut
from llmopt.sampling_params import SamplingParams


def user_turns(stream: list[int], conversations: int, turns: int, tokens: int, seed: int = 0) -> list[list[list[int]]]:
    """[conversation][turn] -> a user message: `tokens` consecutive tokens of `stream` (held-out
    text) from a random place, so that no two conversations share a prefix by accident."""
    rng = random.Random(seed)
    return [[cut(stream, tokens, rng) for _ in range(turns)] for _ in range(conversations)]


def tier_hits(metrics: dict[str, float]) -> dict[str, float]:
    """Prompt tokens from the pool and from each tier below it, so far."""
    hits = {"pool": metrics["prefix_cache_hits"]}
    hits.update({k.removeprefix("kv_offload_hits_"): v for k, v in metrics.items() if k.startswith("kv_offload_hits_")})
    return hits


def run_turns(llm, turns: list[list[list[int]]], answer_tokens: int, on_turn=None) -> list[dict]:
    """Serve every conversation's turns round robin, one request at a time (greedy answers of
    `answer_tokens` tokens, end-of-text ignored). One record per turn: conversation, turn,
    prompt_tokens, ttft_s, and the prompt's tokens by source (pool, each tier, computed).
    `on_turn(record)` is called after each turn (a lesson's live plot)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    contexts: list[list[int]] = [[] for _ in turns]
    records = []
    for t in range(len(turns[0])):
        for c, conversation in enumerate(turns):
            contexts[c] += conversation[t]
            before = tier_hits(engine.get_metrics())
            rid = f"conversation{c}-turn{t}"
            start, ttft, answer = time.perf_counter(), None, []
            engine.add_request(rid, {"prompt_token_ids": list(contexts[c])}, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if ttft is None and out.outputs[0].token_ids:
                        ttft = time.perf_counter() - start
                    answer = list(out.outputs[0].token_ids)
            after = tier_hits(engine.get_metrics())
            found = {k: after[k] - before.get(k, 0.0) for k in after}
            record = {"conversation": c, "turn": t + 1, "prompt_tokens": len(contexts[c]), "ttft_s": ttft,
                      **{f"{k}_tokens": int(v) for k, v in found.items()},
                      "computed_tokens": len(contexts[c]) - int(sum(found.values()))}
            records.append(record)
            contexts[c] += answer
            if on_turn is not None:
                on_turn(record)
    return records


def pool_blocks_for(turns: list[list[list[int]]], answer_tokens: int, block_size: int, share: float) -> int:
    """Blocks for `share` of the KV the conversations hold at their end (a quarter: 0.25), and never
    fewer than the longest conversation's last turn needs (the engine refuses a request it could
    never fit)."""
    ends = [sum(len(m) for m in conversation) + answer_tokens * len(conversation) for conversation in turns]
    return max(round(share * sum(ends) / block_size), -(-max(ends) // block_size) + 1)
