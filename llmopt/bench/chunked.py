"""`chunked`: long prompts arriving while others decode, chunked prefill on and off."""

from __future__ import annotations

import time

from llmopt.bench.common import percentile, progress_bar, table, warm_up
from llmopt.bench.inputs import BenchRequest


def bench_chunked(make_llm, decoders: list[BenchRequest], longs: list[BenchRequest],
                  chunk_budget: int, unchunked_budget: int, arrive_after: int = 8, arrive_every: int = 4,
                  progress: bool = True) -> dict:
    """Requests decode; every `arrive_every` steps (from step `arrive_after`) a long prompt
    arrives. Chunked prefill spreads each long prompt over steps of `chunk_budget` tokens;
    without it, a step runs the whole prompt and every decoder waits for it."""
    out = {"workload": "chunked", "num_decoders": len(decoders), "num_long": len(longs),
           "long_lens": [len(r.prompt_token_ids) for r in longs], "chunk_budget": chunk_budget,
           "unchunked_budget": unchunked_budget, "arrive_after": arrive_after,
           "arrive_every": arrive_every, "runs": {}}
    tokens = {}
    for chunked in (True, False):
        llm = make_llm(enable_chunked_prefill=chunked,
                       max_num_batched_tokens=chunk_budget if chunked else unchunked_budget)
        warm_up(llm)
        engine, done = llm.llm_engine, {}
        for i, r in enumerate(decoders):
            engine.add_request(f"dec-{i}", r.prompt(), r.params())
        arrivals = {arrive_after + k * arrive_every: k for k in range(len(longs))}
        bar = progress_bar(None, f"chunked prefill {'on' if chunked else 'off'}", progress,
                           total=len(decoders) + len(longs))
        step, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests() or step <= max(arrivals, default=0):
            if step in arrivals:
                k = arrivals[step]
                engine.add_request(f"long-{k}", longs[k].prompt(), longs[k].params())
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
                    if bar is not None:
                        bar.update(1)


            step += 1
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        long_out = [done[f"long-{k}"] for k in range(len(longs))]
        dec_out = [done[f"dec-{i}"] for i in range(len(decoders))]
        # the decoders' gaps while long prompts were arriving and being prefilled
        start = min(o.metrics.arrival_time for o in long_out)
        end = max(o.metrics.first_token_time for o in long_out)
        pairs = [(a, b) for o in dec_out for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:])]
        gaps = [b - a for a, b in pairs if b >= start and a <= end]
        all_gaps = [b - a for a, b in pairs]
        ttft = [o.metrics.ttft for o in long_out]
        tokens[chunked] = [o.outputs[0].token_ids for o in dec_out + long_out]
        out["runs"]["on" if chunked else "off"] = {
            "seconds": seconds, "steps": step, "gaps": gaps, "gap_p50": percentile(gaps, 50),
            "gap_p90": percentile(gaps, 90), "gap_max": max(gaps, default=float("nan")),
            "tpot_mean_all": sum(all_gaps) / len(all_gaps), "long_ttft": ttft,
            "long_ttft_mean": sum(ttft) / len(ttft), "long_ttft_p90": percentile(ttft, 90)}
    out["same_tokens"] = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    return out


def chunked_table(r: dict) -> str:
    rows = []
    for key in ("off", "on"):
        x = r["runs"][key]
        budget = r["chunk_budget"] if key == "on" else r["unchunked_budget"]
        rows.append([f"chunked prefill {key} (max_num_batched_tokens {budget})",
                     f"{1e3 * x['gap_p50']:.0f}", f"{1e3 * x['gap_p90']:.0f}", f"{1e3 * x['gap_max']:.0f}",
                     f"{1e3 * x['tpot_mean_all']:.0f}", f"{1e3 * x['long_ttft_mean']:.0f}",
                     f"{1e3 * x['long_ttft_p90']:.0f}", f"{x['seconds']:.1f}"])
    on, off = r["runs"]["on"], r["runs"]["off"]
    n = r["num_decoders"] + r["num_long"]
    return (f"{r['num_decoders']} requests decoding; {r['num_long']} prompts of "
            f"{min(r['long_lens'])}-{max(r['long_lens'])} tokens (16 output tokens each) arrive one "
            f"every {r['arrive_every']} steps from step {r['arrive_after']}. Inter-token gaps of the "
            "decoding requests while the "
            "long prompts arrive and prefill; TPOT mean over their whole run.\n\n"
            + table(["run", "gap p50 (ms)", "gap p90 (ms)", "gap max (ms)", "decoders' TPOT mean (ms)",
                     "long prompts' TTFT mean (ms)", "TTFT p90 (ms)", "time (s)"], rows)
            + f"\n\nchunked prefill on / off: gap p50 x{on['gap_p50'] / off['gap_p50']:.2f}, gap p90 "
            f"x{on['gap_p90'] / off['gap_p90']:.2f}, gap max x{on['gap_max'] / off['gap_max']:.2f}, "
            f"long prompts' TTFT mean x{on['long_ttft_mean'] / off['long_ttft_mean']:.2f}; "
            f"greedy tokens identical on vs off: {r['same_tokens']}/{n}")
