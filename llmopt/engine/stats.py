"""What the engine reports about itself: per-step trace records, KV memory, and metrics.

`trace_record` is one step as the lessons' timeline and block-table views replay it (who
ran, how many tokens of which kind, blocks allocated and freed, prefix hits); `metrics` is
`LLM.get_metrics()`, with vLLM's names (tokens counted as vLLM counts them).
"""

from __future__ import annotations

import time

from llmopt.layers.moe import moe_step_stats


def trace_record(engine, sched, before: dict, finished: list[str], spec_results: dict) -> dict:
    """One step: `before` maps each scheduled request to (context length, drafts) before it."""
    bm = engine.block_manager
    # decode work: one new token (plus its speculative drafts) after the whole prompt;
    # anything else, a recompute after preemption included, is prefill work
    is_decode = {s.request_id: before[s.request_id][0] >= len(s.prompt_token_ids) and
                 n == 1 + before[s.request_id][1] for s, n in sched.scheduled}
    return {
        "step": engine.step_count, "time": time.perf_counter(),
        "scheduled": [{"request_id": s.request_id, "num_tokens": n,
                       "context_len": before[s.request_id][0],
                       "num_draft_tokens": before[s.request_id][1],
                       # speculation: the drafts, and what the verification emitted (the
                       # accepted prefix of the drafts, then a replacement or bonus token)
                       **spec_results.get(s.request_id, {}),
                       "kind": "decode" if before[s.request_id][0] >= len(s.prompt_token_ids)
                       else "prefill"} for s, n in sched.scheduled],
        "num_prefill_tokens": sum(n for s, n in sched.scheduled if not is_decode[s.request_id]),
        "num_decode_tokens": sum(n for s, n in sched.scheduled if is_decode[s.request_id]),
        "preempted": [s.request_id for s in sched.preempted],
        "finished": finished,
        "blocks_allocated": list(bm.step_allocated), "blocks_freed": list(bm.step_freed),
        "prefix_hit_tokens": bm.prefix_hits - sched.prefix_hits_before,
        "block_tables": {rid: list(t) for rid, t in bm.block_tables.items()},
        "num_running": len(engine.scheduler.running), "num_waiting": len(engine.scheduler.waiting),
        **memory_stats(engine),
        **moe_step_stats(engine.model),  # DeepSeek: tokens per expert, load imbalance
    }


def memory_stats(engine) -> dict[str, float]:
    """Blocks used, slots they reserve, and tokens actually stored in them."""
    bm, block_size = engine.block_manager, engine.block_size
    filled: dict[int, int] = {}
    for seq in engine.scheduler.running:
        table = bm.block_tables.get(seq.request_id, [])
        for i, b in enumerate(table):
            n = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
            filled[b] = max(filled.get(b, 0), n)
    used = engine.num_blocks - bm.num_free_blocks
    return {"num_blocks": engine.num_blocks, "blocks_used": used,
            "blocks_cached": bm.num_cached_blocks, "slots_reserved": used * block_size,
            "tokens_stored": sum(filled.values()), "kv_cache_usage_perc": bm.usage}


def metrics(engine) -> dict[str, float]:
    bm, spec = engine.block_manager, engine.spec_stats
    return {
        "kv_cache_usage_perc": bm.usage,
        "num_preemptions": float(engine.scheduler.num_preemptions),
        "prefix_cache_queries": float(bm.prefix_queries),
        "prefix_cache_hits": float(bm.prefix_hits),
        "spec_decode_num_drafts": float(spec["num_drafts"]),
        "spec_decode_num_draft_tokens": float(spec["num_draft_tokens"]),
        "spec_decode_num_accepted_tokens": float(spec["num_accepted_tokens"]),
        # mean tokens a verification step yields per sequence: 1 + accepted / drafts
        "spec_decode_mean_acceptance_length": 1.0 + spec["num_accepted_tokens"] / max(1, spec["num_drafts"]),
        **{f"spec_decode_num_accepted_tokens_per_pos_{i}": float(c)
           for i, c in enumerate(spec["accepted_per_position"])},
        "num_requests_running": float(len(engine.scheduler.running)),
        # a constrained request whose grammar is compiling waits too (vLLM: WAITING_FOR_FSM)
        "num_requests_waiting": float(len(engine.scheduler.waiting) + len(engine.structured.pending)),
        "num_kv_blocks": float(engine.num_blocks),
        **(bm.offload.metrics() if getattr(bm, "offload", None) is not None else {}),  # hits per tier
        **{k: float(v) for k, v in engine.stats.items()},
        **{k: float(v) for k, v in engine.structured.stats.items()},
    }
