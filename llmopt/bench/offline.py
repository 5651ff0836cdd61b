"""`offline`: mixed requests through HF static batches, one at a time, and the engine; and a
profile of where a decode step's time goes."""

from __future__ import annotations

import time

from llmopt.bench.common import (common_prefix_share, hf_static_batches, load_hf_model,
                                 one_at_a_time, run_engine, table, warm_up)
from llmopt.bench.inputs import BenchRequest


def bench_offline(llm, requests: list[BenchRequest], batch_sizes: list[int],
                  progress: bool = True) -> dict:
    """The same requests through the engine, one at a time, and HF static batches of each size."""
    n, asked = len(requests), sum(r.max_tokens for r in requests)
    warm_up(llm)
    metrics_before = llm.get_metrics()
    t_engine, outs = run_engine(llm, requests, progress)
    engine_tokens = [o.outputs[0].token_ids for o in outs]
    preemptions = llm.get_metrics()["num_preemptions"] - metrics_before["num_preemptions"]
    runs = {"engine": (t_engine, engine_tokens, asked)}

    one_at_a_time(llm, requests[:1], False)  # warm up
    t_one, one_tokens = one_at_a_time(llm, requests, progress)
    runs["one_at_a_time"] = (t_one, one_tokens, asked)

    hf = load_hf_model(llm)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    hf_static_batches(hf, requests[:2], 2, pad, False)  # warm up
    for bs in batch_sizes:
        runs[f"hf_static_{bs}"] = hf_static_batches(hf, requests, bs, pad, progress)
    del hf

    systems = {}
    for name, (clock, tokens, computed) in runs.items():
        systems[name] = {
            "seconds": clock.wall, "cpu_seconds": clock.cpu, "tokens_per_s": asked / clock.wall,
            "tokens_computed": computed, "engine_speedup": clock.wall / t_engine.wall,
            "engine_speedup_cpu": clock.cpu / t_engine.cpu,
            "identical_to_engine": sum(a == b for a, b in zip(tokens, engine_tokens)),


            "common_prefix_share": sum(map(common_prefix_share, tokens, engine_tokens)) / n,
            "tokens": tokens}
    return {
        "workload": "offline", "num_requests": n, "batch_sizes": list(batch_sizes),
        "prompt_lens": [len(r.prompt_token_ids) for r in requests],
        "max_tokens": [r.max_tokens for r in requests], "tokens_asked": asked,
        "engine_num_preemptions": preemptions, "systems": systems}


def offline_table(r: dict) -> str:
    n, sy = r["num_requests"], r["systems"]
    labels = {f"hf_static_{bs}": f"HF transformers `generate`, static batches of {bs}"
              for bs in r["batch_sizes"]}
    labels["one_at_a_time"] = "llmopt, one request at a time (contiguous cache)"
    labels["engine"] = "llmopt engine (continuous batching, paged KV)"
    rows = []
    for key, label in labels.items():
        x = sy[key]
        same = f"{x['identical_to_engine']}/{n}"
        if key.startswith("hf") and x["identical_to_engine"] < n:
            same += f" ({100 * x['common_prefix_share']:.0f}% of tokens before the first difference)"
        rows.append([label, f"{x['tokens_per_s']:.0f}", f"{x['seconds']:.1f}", f"{x['cpu_seconds']:.1f}",
                     f"{x['tokens_computed']:,}", f"{x['engine_speedup']:.2f}x",
                     f"{x['engine_speedup_cpu']:.2f}x", "-" if key == "engine" else same])
    head = ["system", "generated tokens/s", "time (s)", "CPU time (s)",
            "tokens generated (incl. discarded)", "engine speedup", "engine speedup in CPU time", "greedy tokens identical to the engine's"]
    hf = [sy[f"hf_static_{bs}"] for bs in r["batch_sizes"]]
    vs_hf, vs_hf_cpu = min(x["engine_speedup"] for x in hf), min(x["engine_speedup_cpu"] for x in hf)
    pl, mt = r["prompt_lens"], r["max_tokens"]
    return (f"{n} requests, prompts {min(pl)}-{max(pl)} tokens ({sum(pl):,} in all), outputs "
            f"{min(mt)}-{max(mt)} tokens ({r['tokens_asked']:,} asked for; tokens/s counts only those), "
            f"greedy, ignore_eos, all submitted at once. Engine preemptions: "
            f"{r['engine_num_preemptions']:.0f}. CPU time is this process's, all threads.\n\n"
            + table(head, rows)
            + f"\n\nengine / HF static batching (its faster batch size): {vs_hf:.2f}x in wall time, "
            f"{vs_hf_cpu:.2f}x in CPU time (goal >= 4x: {'met' if vs_hf >= 4 else 'NOT met'}); "
            f"engine / one at a time: {sy['one_at_a_time']['engine_speedup']:.2f}x")


# where the torch ops of a decode step come from, for the profile's table
OP_SOURCES = {
    "aten::index_select": "KV blocks gathered into a padded copy per layer (paged cache, torch path)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
    "aten::_scaled_dot_product_attention_math": "attention (SDPA, math fallback)",
    "aten::mm": "the model's linear layers (weights)",
    "aten::addmm": "the model's linear layers (weights)",
    "aten::argmax": "greedy sampling",
}


def profile_decode(llm, requests: list[BenchRequest], steps: int = 10, top: int = 8) -> dict:
    """torch.profiler over `steps` engine steps once a full batch is decoding: where a step's
    time goes, op by op (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    sched = engine.scheduler
    for i, r in enumerate(requests[:sched.max_num_seqs]):
        engine.add_request(f"prof-{i}", r.prompt(), r.params())
    while sched.waiting or any(s.num_computed_tokens < len(s.prompt_token_ids) for s in sched.running):
        engine.step()  # until every prompt is prefilled
    batch = len(sched.running)
    context = sum(s.num_tokens for s in sched.running) / max(batch, 1)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - t0) / steps
    engine.abort_request(list(engine.requests))
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    return {"steps": steps, "batch": batch, "mean_context": context, "ms_per_step": 1e3 * wall,
            "ops": [{"op": e.key, "share": e.self_cpu_time_total / total,
                     "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps,
                     "source": OP_SOURCES.get(e.key, "")} for e in ops[:top]]}


def profile_table(p: dict) -> str:
    rows = [[f"`{o['op']}`", f"{100 * o['share']:.1f}%", f"{o['ms_per_step']:.1f}",
             f"{o['calls_per_step']:.0f}", o["source"]] for o in p["ops"]]
    return (f"Where a decode step's time goes: torch.profiler over {p['steps']} engine steps with "
            f"{p['batch']} requests decoding (mean context {p['mean_context']:.0f} tokens), "
            f"{p['ms_per_step']:.0f} ms per step under the profiler.\n\n"
            + table(["op", "self CPU share", "ms per step", "calls per step", "from"], rows))
