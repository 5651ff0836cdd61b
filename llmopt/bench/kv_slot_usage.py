"""`kv-memory`: the share of reserved KV slots that hold tokens, paged vs contiguous reservations."""

from __future__ import annotations

from llmopt.bench.common import progress_bar, table
from llmopt.bench.inputs import BenchRequest


def bench_kv_memory(llm, requests: list[BenchRequest], progress: bool = True) -> dict:
    """Replay the engine's schedule (its trace) under three ways of reserving KV memory."""
    engine = llm.llm_engine
    if engine.trace is None:
        raise ValueError("kv-memory needs an engine created with enable_trace=True")
    asked = {f"kv-{i}": len(r.prompt_token_ids) + r.max_tokens for i, r in enumerate(requests)}
    for i, r in enumerate(requests):
        engine.add_request(f"kv-{i}", r.prompt(), r.params())
    start = len(engine.trace)
    bar = progress_bar(None, "kv-memory (traced engine)", progress, total=len(requests))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    per_token = engine.bytes_per_block / engine.block_size
    computed: dict[str, int] = {}
    steps = {"paged": [], "contiguous_prompt_plus_max_tokens": [], "contiguous_max_model_len": []}
    for rec in engine.trace[start:]:
        for s in rec["scheduled"]:
            computed[s["request_id"]] = s["context_len"] + s["num_tokens"]
        running = list(rec["block_tables"])  # requests holding blocks after this step
        if not running or rec["slots_reserved"] == 0:
            continue
        stored = sum(computed.get(rid, 0) for rid in running)
        steps["paged"].append((rec["tokens_stored"], rec["slots_reserved"]))
        steps["contiguous_prompt_plus_max_tokens"].append(
            (stored, sum(min(asked[rid], engine.max_model_len) for rid in running)))
        steps["contiguous_max_model_len"].append((stored, len(running) * engine.max_model_len))
    out = {"workload": "kv-memory", "num_requests": len(requests), "block_size": engine.block_size,
           "max_model_len": engine.max_model_len, "bytes_per_token": per_token, "schemes": {}}


    for name, pairs in steps.items():
        out["schemes"][name] = {
            "mean_share_over_steps": sum(a / b for a, b in pairs) / len(pairs),
            "weighted_share": sum(a for a, _ in pairs) / sum(b for _, b in pairs),
            "peak_slots_reserved": max(b for _, b in pairs),
            "share_per_step": [a / b for a, b in pairs]}
    out["num_steps"] = len(steps["paged"])
    return out


def kv_memory_table(r: dict) -> str:
    names = {"paged": f"paged, blocks of {r['block_size']} (engine trace)",
             "contiguous_prompt_plus_max_tokens": "contiguous, prompt + max_tokens per request",
             "contiguous_max_model_len": f"contiguous, max_model_len ({r['max_model_len']}) per request"}
    rows = []
    for key, label in names.items():
        s = r["schemes"][key]
        rows.append([label, f"{100 * s['mean_share_over_steps']:.1f}%", f"{100 * s['weighted_share']:.1f}%",
                     f"{s['peak_slots_reserved']:,}",
                     f"{s['peak_slots_reserved'] * r['bytes_per_token'] / 2**20:.0f}"])
    paged = r["schemes"]["paged"]["mean_share_over_steps"]
    return (f"{r['num_requests']} requests (the offline workload), {r['num_steps']} engine steps. "
            "Share of reserved KV slots that hold a token: the mean over steps of "
            "stored/reserved, and the weighted share (sum of stored / sum of reserved over steps). "
            "The contiguous rows replay the engine's own schedule.\n\n"
            + table(["KV reservation", "slots holding tokens (mean over steps)",
                     "(weighted by slots)", "peak slots reserved", "peak MiB"], rows)
            + f"\n\npaged: {100 * paged:.1f}% (goal >= 90%: {'met' if paged >= 0.9 else 'NOT met'})")
