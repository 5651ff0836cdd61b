"""`prefix`: requests sharing a system prompt, prefix caching on and off."""

from __future__ import annotations


from llmopt.bench.common import percentile, run_engine, table, warm_up
from llmopt.bench.inputs import BenchRequest


def bench_prefix(make_llm, prefix: list[int], requests: list[BenchRequest],
                 progress: bool = True) -> dict:
    """The same requests (shared prefix + own suffix) with prefix caching on and off."""
    full = [BenchRequest(prefix + r.prompt_token_ids, r.max_tokens) for r in requests]
    asked = sum(r.max_tokens for r in full)
    out = {"workload": "prefix", "num_requests": len(full), "prefix_len": len(prefix),
           "suffix_lens": [len(r.prompt_token_ids) for r in requests], "runs": {}}
    tokens = {}
    for caching in (True, False):
        llm = make_llm(enable_prefix_caching=caching)
        warm_up(llm)
        before = llm.get_metrics()
        clock, outs = run_engine(llm, full, progress)
        seconds = clock.wall
        after = llm.get_metrics()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        ttft = [o.metrics.ttft for o in outs]
        tokens[caching] = [o.outputs[0].token_ids for o in outs]
        out["runs"]["on" if caching else "off"] = {
            "seconds": seconds, "tokens_per_s": asked / seconds, "ttft": ttft,
            "ttft_mean": sum(ttft) / len(ttft), "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90), "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "hit_rate": hits / queries if queries else 0.0}
    out["same_tokens"] = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    return out


def prefix_table(r: dict) -> str:
    rows = []
    for key in ("off", "on"):
        x = r["runs"][key]


        rows.append([f"prefix caching {key}", f"{1e3 * x['ttft_mean']:.0f}", f"{1e3 * x['ttft_p50']:.0f}",
                     f"{1e3 * x['ttft_p90']:.0f}", f"{x['tokens_per_s']:.0f}", f"{x['seconds']:.1f}",
                     f"{100 * x['hit_rate']:.1f}%"])
    on, off = r["runs"]["on"], r["runs"]["off"]
    sl = r["suffix_lens"]
    return (f"{r['num_requests']} requests submitted at once, each a shared {r['prefix_len']}-token "
            f"prefix + its own {min(sl)}-{max(sl)}-token suffix; TTFT counts from submission "
            "(queueing included). Hit rate = prefix_cache_hits / prefix_cache_queries (tokens).\n\n"
            + table(["run", "TTFT mean (ms)", "TTFT p50 (ms)", "TTFT p90 (ms)", "generated tokens/s",
                     "time (s)", "prefix cache hit rate"], rows)
            + f"\n\nprefix caching on / off: TTFT mean x{on['ttft_mean'] / off['ttft_mean']:.2f}, "
            f"TTFT p90 x{on['ttft_p90'] / off['ttft_p90']:.2f}, throughput "
            f"x{on['tokens_per_s'] / off['tokens_per_s']:.2f}; greedy tokens identical on vs off: "
            f"{r['same_tokens']}/{r['num_requests']}")
