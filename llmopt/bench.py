"""Benchmarks, always side by side with their baseline in one run, reported as ratios.

Every workload runs its baselines in the same process, on the same requests, and prints
one markdown table whose first line names the model, dtype, threads, CPU and command:
absolute numbers on a shared CPU drift from run to run, the ratios are what to read.

- `kv-cache`: naive loop (recompute everything) vs KV-cache loop, one prompt, L tokens.
- `offline`: a mixed batch of requests (prompt 32-512, output 32-256 tokens, real code
  from the held-out text) through Hugging Face `generate` in static batches, through
  llmopt one request at a time, and through the engine (continuous batching).
- `kv-memory`: the same requests; the share of reserved KV slots that hold tokens, paged
  vs contiguous reservations (per request max_model_len, or prompt + max_tokens).
- `prefix`: requests sharing a system prompt: TTFT and throughput, prefix caching on/off.
- `chunked`: long prompts arriving while others decode: the decoders' inter-token gaps
  and the long prompts' TTFT, chunked prefill on/off.
- `spec`: plain decoding vs each speculative method (n-gram, draft model, EAGLE head) at
  k in {2, 4, 6}, with Leviathan et al.'s prediction: in `llmopt.bench_spec`.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.engine.generate import generate_naive, generate_with_cache
from llmopt.engine.sequence import Sequence
from llmopt.sampling_params import SamplingParams

WORKLOADS = ["kv-cache", "offline", "kv-memory", "prefix", "chunked", "spec"]
# Sizes when a flag is not given: num_requests, prompt_len (min, max), output_len (min, max).
# For `prefix` prompt_len is the length of each distinct suffix after the shared prefix;
# for `chunked` the counts and lengths are those of the requests that decode.
DEFAULTS = {
    "offline": dict(num_requests=128, prompt_len=(32, 512), output_len=(32, 256)),
    "kv-memory": dict(num_requests=128, prompt_len=(32, 512), output_len=(32, 256)),
    "prefix": dict(num_requests=64, prompt_len=(16, 64), output_len=(32, 32)),
    "chunked": dict(num_requests=8, prompt_len=(64, 128), output_len=(96, 96)),
    "spec": dict(num_requests=16, prompt_len=(64, 256), output_len=(128, 128)),
}

@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int

    def params(self) -> SamplingParams:
        # greedy, and every request generates exactly what it asked for
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)

    def prompt(self) -> dict:
        return {"prompt_token_ids": self.prompt_token_ids}


# -- inputs -------------------------------------------------------------------------------------
def heldout_text() -> str:
    """Python stdlib source held out from the bundled models' training (written by the
    training script beside the bundled models)."""
    from llmopt.model.registry import BUNDLED_DIR

    places = [BUNDLED_DIR / "heldout.txt"]
    if (BUNDLED_DIR / "tiny").exists():
        places.append((BUNDLED_DIR / "tiny").resolve().parent / "heldout.txt")
    for p in places:
        if p.is_file():
            return p.read_text(encoding="utf-8")
    raise ValueError(f"no held-out text at {places[0]}; run scripts/train_tiny_models.py")


def heldout_tokens(tokenizer) -> list[int]:
    return tokenizer(heldout_text(), verbose=False)["input_ids"]


def cut(stream: list[int], n: int, rng: random.Random) -> list[int]:
    """n consecutive tokens from a random offset of the stream."""
    start = rng.randrange(0, len(stream) - n)
    return stream[start:start + n]


def make_requests(stream, num_requests, prompt_len, output_len, seed=0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(cut(stream, rng.randint(*prompt_len), rng), rng.randint(*output_len))
            for _ in range(num_requests)]


# -- small helpers ------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(llm, command: str) -> str:
    import transformers

    n = sum(p.numel() for p in llm.model.parameters())
    return (f"model `{llm.config.model}` ({n:,} params), {llm.dtype}, {llm.device}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{torch.get_num_threads()} threads, {cpu_name()} ({os.cpu_count()} cores); "
            f"command: `{command}`")


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def progress_bar(items, desc: str, on: bool, total: int | None = None):
    if not on:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, total=total, dynamic_ncols=True)


def warm_up(llm) -> None:
    """One short request first, so allocator and thread-pool start-up is not timed."""
    ids = list(range(3, 67))
    llm.generate([{"prompt_token_ids": ids}] * 2, SamplingParams(temperature=0.0, max_tokens=4,
                                                                ignore_eos=True), use_tqdm=False)


@dataclass
class Clock:
    """Wall time and this process's CPU time (all threads). On a CPU shared with other jobs
    the wall time of a run depends on what else ran meanwhile; with one thread, its CPU time
    is close to what it would take alone."""

    wall: float
    cpu: float

    @staticmethod
    def start() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    @classmethod
    def since(cls, t0: tuple[float, float]) -> Clock:
        return cls(time.perf_counter() - t0[0], time.process_time() - t0[1])


def run_engine(llm, requests: list[BenchRequest], progress: bool) -> tuple[Clock, list]:
    t0 = Clock.start()
    outs = llm.generate([r.prompt() for r in requests], [r.params() for r in requests],
                        use_tqdm=progress)
    return Clock.since(t0), outs


def one_at_a_time(llm, requests: list[BenchRequest], progress: bool) -> tuple[Clock, list[list[int]]]:
    """llmopt's contiguous-cache loop, each request alone (no batching at all)."""
    tokens = []
    t0 = Clock.start()
    for i, r in enumerate(progress_bar(requests, "llmopt one at a time", progress)):
        seq = Sequence(f"one-{i}", None, r.prompt_token_ids, r.params())
        generate_with_cache(llm.model, [seq], eos_token_ids=llm.eos_token_ids,
                            max_model_len=llm.max_model_len)
        tokens.append(seq.output_token_ids)
    return Clock.since(t0), tokens


def load_hf_model(llm):
    from transformers import AutoModelForCausalLM

    from llmopt.model.gguf import is_gguf

    path = llm.llm_engine.model_path
    # the same weights the engine runs: a GGUF file is dequantized by transformers' own reader
    where = {"gguf_file": path.name} if is_gguf(path) else {}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent if where else path), dtype=llm.dtype, **where)
    return model.to(llm.device).eval()


@torch.inference_mode()
def hf_static_batches(hf_model, requests: list[BenchRequest], batch_size: int, pad_id: int,
                      progress: bool) -> tuple[Clock, list[list[int]], int]:
    """Hugging Face `generate`, `batch_size` requests at a time, left-padded. A static batch
    runs until its longest request is done; every row then keeps only what it asked for.
    Returns (clock, tokens per request, tokens computed including that waste)."""
    from transformers import GenerationConfig

    dev = next(hf_model.parameters()).device
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    tokens, computed = [], 0
    t0 = Clock.start()
    for batch in progress_bar(batches, f"HF generate, static batches of {batch_size}", progress):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = [[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                for r in batch]
        new = max(r.max_tokens for r in batch)
        # eos_token_id=None: like ignore_eos, rows never stop early (and are never padded)
        config = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=None,
                                  pad_token_id=pad_id)
        out = hf_model.generate(input_ids=torch.tensor(ids, device=dev),
                                attention_mask=torch.tensor(mask, device=dev), generation_config=config)
        rows = out[:, width:].tolist()
        tokens += [row[:r.max_tokens] for row, r in zip(rows, batch)]
        computed += new * len(batch)
    return Clock.since(t0), tokens, computed


def common_prefix_share(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)


# -- workloads ----------------------------------------------------------------------------------
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


# -- kv-cache (the first lesson's benchmark) ----------------------------------------------------
def time_generation(llm, loop, prompt_ids: list[int], n_tokens: int) -> dict:
    seq = Sequence("bench", None, prompt_ids,
                   SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    loop(llm.model, [seq], eos_token_ids=llm.eos_token_ids, max_model_len=llm.max_model_len)
    total = time.perf_counter() - t0
    times = [t0] + seq.metrics.token_times
    gaps = [b - a for a, b in zip(times[:-1], times[1:])]
    tail = gaps[-max(1, len(gaps) // 10):]  # the last 10% of tokens
    return {"tokens": len(seq.output_token_ids), "total_s": total,
            "ms_per_token": 1e3 * total / len(seq.output_token_ids),
            "last_ms_per_token": 1e3 * sum(tail) / len(tail), "token_ids": seq.output_token_ids}


def kv_cache_table(llm, lengths: list[int], prompt: str = "def ", progress: bool = True,
                   command: str | None = None) -> str:
    prompt_ids = llm.tokenizer(prompt)["input_ids"]
    rows = []
    items = [(n, name, loop) for n in lengths
             for name, loop in (("naive", generate_naive), ("kv-cache", generate_with_cache))]
    for loop in (generate_naive, generate_with_cache):  # warm up (allocator, thread pools)
        time_generation(llm, loop, prompt_ids, 8)
    results = {}
    for n, name, loop in progress_bar(items, "kv-cache bench", progress):
        results[(n, name)] = time_generation(llm, loop, prompt_ids, n)
    for n in lengths:
        a, b = results[(n, "naive")], results[(n, "kv-cache")]
        same = "yes" if a["token_ids"] == b["token_ids"] else "NO"
        rows.append([n, f"{a['ms_per_token']:.2f}", f"{b['ms_per_token']:.2f}",
                     f"{a['ms_per_token'] / b['ms_per_token']:.1f}x", f"{a['last_ms_per_token']:.2f}",
                     f"{b['last_ms_per_token']:.2f}",
                     f"{a['last_ms_per_token'] / b['last_ms_per_token']:.1f}x", same])
    head = ["tokens generated", "naive ms/token", "cached ms/token", "speedup",
            "naive ms/token (last 10%)", "cached ms/token (last 10%)", "speedup (last 10%)", "same tokens"]
    command = command or f"llmopt bench --workload kv-cache --lengths {' '.join(map(str, lengths))}"
    return header(llm, command) + "\n\n" + table(head, rows)


# -- entry points -------------------------------------------------------------------------------
def command_line(args, prog: str = "llmopt bench") -> str:
    """The command that reproduces `args`: the workload, then every flag not at its default."""
    from llmopt.cli import build_parser

    defaults = vars(build_parser().parse_args(["bench"]))
    parts = prog.split() + ["--workload", args.workload]
    for key, value in vars(args).items():
        if key in ("command", "workload") or value == defaults.get(key):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            parts += [flag, *map(str, value)]
        elif isinstance(value, dict):
            parts += [flag, json.dumps(value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def run_workload(args, command: str | None = None) -> tuple[str, dict]:
    """Run the workload `args.workload` names: (markdown with its header line, raw numbers)."""
    threads = torch.get_num_threads()
    if args.threads:
        # On a CPU shared with other jobs, fewer threads than cores can be much faster:
        # an oversubscribed thread pool waits for its slowest thread at every operation.
        torch.set_num_threads(args.threads)
    try:
        return _run_workload(args, command)
    finally:
        torch.set_num_threads(threads)


def _run_workload(args, command: str | None) -> tuple[str, dict]:
    from llmopt import LLM
    from llmopt.cli import engine_kwargs

    command = command or command_line(args)
    w = args.workload
    kwargs = engine_kwargs(args)
    progress = args.progress

    def make_llm(**override):
        return LLM(**{**kwargs, **override})

    if w == "kv-cache":
        llm = make_llm()
        text = kv_cache_table(llm, args.lengths, args.prompt, progress, command)
        return text, {"workload": w, "table": text}
    d = DEFAULTS[w]
    n = args.num_requests or d["num_requests"]
    prompt_len = tuple(args.prompt_len or d["prompt_len"])
    output_len = tuple(args.output_len or d["output_len"])
    llm = make_llm(enable_trace=True) if w == "kv-memory" else make_llm()
    stream = heldout_tokens(llm.tokenizer)
    if w in ("offline", "kv-memory"):
        requests = make_requests(stream, n, prompt_len, output_len, args.workload_seed)
        if w == "offline":
            raw = bench_offline(llm, requests, args.batch_size, progress)
            body = offline_table(raw)
            if args.profile_steps:
                raw["profile"] = profile_decode(llm, requests, args.profile_steps)
                body += "\n\n" + profile_table(raw["profile"])
        else:
            raw = bench_kv_memory(llm, requests, progress)
            body = kv_memory_table(raw)
    elif w == "prefix":
        rng = random.Random(args.workload_seed)
        prefix = cut(stream, args.prefix_len, rng)
        requests = make_requests(stream, n, prompt_len, output_len, args.workload_seed + 1)
        raw = bench_prefix(make_llm, prefix, requests, progress)
        body = prefix_table(raw)
    elif w == "chunked":
        decoders = make_requests(stream, n, prompt_len, output_len, args.workload_seed)
        longs = make_requests(stream, args.num_long, (args.long_len, args.long_len), (16, 16),
                              args.workload_seed + 1)
        raw = bench_chunked(make_llm, decoders, longs, args.chunk_budget,
                            max(args.max_num_batched_tokens, args.long_len + n), progress=progress)
        body = chunked_table(raw)
    elif w == "spec":
        requests = make_requests(stream, n, prompt_len, output_len, args.workload_seed)
        from llmopt.bench_spec import bench_spec, spec_table

        raw = bench_spec(make_llm, requests, args.spec_methods, args.spec_k,
                         min(args.spec_batch1, n), progress)
        body = spec_table(raw)
    else:
        raise ValueError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    raw.update(model=llm.config.model, dtype=str(llm.dtype), threads=torch.get_num_threads(),
               cpu=cpu_name(), torch=torch.__version__, command=command)
    return header(llm, command) + "\n\n" + body, raw


def for_json(raw: dict) -> dict:
    """The raw numbers without the generated token lists (kept in memory for the checks)."""
    if "systems" not in raw:
        return raw
    systems = {k: {a: b for a, b in v.items() if a != "tokens"} for k, v in raw["systems"].items()}
    return {**raw, "systems": systems}


def run_bench(args) -> str:
    text, raw = run_workload(args)
    if args.out:
        Path(args.out).write_text(f"# llmopt bench: {args.workload}\n\n{text}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(for_json(raw)) + "\n")
    return text
