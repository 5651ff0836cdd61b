"""`roofline`: is a decode step as fast as reading its bytes allows?

A decode step reads every weight once (whatever the batch size) and each sequence's cached
keys and values, and does about two flops per weight per sequence: at small batch the
machine's memory bandwidth, not its arithmetic, sets the step time. So the floor of a step is

    step time >= (weight bytes + KV bytes attended) / read bandwidth,

and the share of the bandwidth a step achieves says how much of its time is the model and how
much is everything else (per-op overhead, gathers, slow kernels). As gpt-fast does, every
figure here carries its GB/s.

1. The machine: STREAM's four kernels (copy, scale, add, triad a = b + s * c) and a plain read
   over initialized arrays at least 10x the last-level cache, per thread count, the best of
   several runs; the best kernel is the bandwidth the step is held to. (`torch.empty` pages never
   written read as the kernel's shared zero page, which reports several times the real
   bandwidth: every array here is written first.)
2. The engine: B sequences with `context` tokens cached each, then `steps` decode steps timed
   one by one; bytes per step, step time, achieved GB/s and its share of the read bandwidth,
   for every batch size, and the batch where step time starts to grow (the bend).
"""

from __future__ import annotations

import statistics
import time

import torch

from llmopt.bench.common import table


# -- 1. the machine's bandwidth ----------------------------------------------------------------------

def stream_megabytes(llc: int | None = None) -> int:
    """STREAM's rule for its arrays: each at least 10x the last-level cache, so that every pass
    reads memory, not cache (512 MB at the least; 3 GB where the LLC is 300 MB)."""
    from llmopt.bench.common import llc_bytes

    llc = llc_bytes() if llc is None else llc
    return max(512, -(-10 * (llc or 0) // 2**20))


def measure_bandwidth(thread_counts=(1, 2), megabytes: int | None = None, repeats: int = 5) -> list[dict]:
    """GB/s of STREAM's kernels on float32 arrays of `megabytes` each (default `stream_megabytes`),
    per thread count, each the best of `repeats`; plus a plain read (a sum). Bytes counted as
    STREAM counts them: read 1, copy and scale 2, add and triad 3 arrays' worth. A row's "best" is
    the highest of them: the bandwidth this machine showed it can reach."""
    n = (megabytes or stream_megabytes()) * 2**20 // 4
    a, b, c = (torch.rand(n) for _ in range(3))  # written: every page is real memory
    before = torch.get_num_threads()
    rows = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            kernels = {"read": (lambda: b.sum(), 1), "copy": (lambda: a.copy_(b), 2),
                       "scale": (lambda: torch.mul(b, 3.0, out=a), 2), "add": (lambda: torch.add(b, c, out=a), 3),
                       "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3)}
            row = {"threads": threads, "array_mb": n * 4 // 2**20}
            for name, (fn, arrays) in kernels.items():
                fn()  # warm
                best = min(_seconds(fn) for _ in range(repeats))
                row[name] = arrays * n * 4 / best / 1e9
            row["best"] = max(row[k] for k in kernels)
            rows.append(row)
    finally:
        torch.set_num_threads(before)
    return rows


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- 2. what a decode step must read -------------------------------------------------------------------

def weight_bytes_per_step(model) -> int:
    """Bytes of every weight a decode step reads once: the decoder's layers and the lm_head.

    A layer that keeps its weights in a format of its own says what it reads (`weight_bytes()`);
    the token embedding is a lookup of B rows (nothing, next to the rest), unless it is tied to
    the lm_head, which reads all of it; so is the RoPE table (100 MB for Llama 3's 131,072
    positions, of which a step reads B rows)."""
    total, seen = 0, set()
    stack = getattr(model, "model", None)
    embed, rotary = getattr(stack, "embed_tokens", None), getattr(stack, "rotary_emb", None)
    skip = {id(p) for p in embed.parameters()} if embed is not None else set()
    skip |= {id(b) for b in rotary.buffers()} if rotary is not None else set()
    head = getattr(model, "lm_head", None)
    if head is not None:
        skip -= {id(p) for p in head.parameters()}  # tied: the head reads the whole matrix
    for m in model.modules():
        own = getattr(m, "weight_bytes", None)
        if own is not None:
            total += int(own() if callable(own) else own)
            seen |= {id(t) for t in list(m.parameters()) + list(m.buffers())}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or id(t) in skip:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(engine) -> int:
    """Bytes one cached token takes in the engine's pool, all layers (K and V)."""
    return engine.bytes_per_block // engine.block_size


# -- 3. timing decode steps ---------------------------------------------------------------------------------

def time_decode_steps(llm, batch: int, context: int, steps: int, token_ids: list[int]) -> list[float]:
    """Seconds of each of `steps` engine steps in which `batch` sequences decode one token each,
    after `context` tokens of each are in the cache."""
    from llmopt.sampling_params import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"roofline-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        start = (i * 7919) % max(1, len(token_ids) - context)
        engine.add_request(rid, {"prompt_token_ids": token_ids[start:start + context]}, params)
    seqs = [engine.requests[rid] for rid in ids]
    try:
        while any(not s.output_token_ids for s in seqs):  # prefill (in chunks if need be)
            engine.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times
    finally:
        engine.abort_request(ids)


def bench_roofline(llm, batches: list[int], context: int, steps: int, token_ids: list[int],
                   bandwidth: list[dict], progress: bool = True) -> dict:
    from llmopt.bench.common import progress_bar

    engine = llm.llm_engine
    weights = weight_bytes_per_step(engine.model)
    per_token = kv_bytes_per_token(engine)
    threads = torch.get_num_threads()
    here = [r for r in bandwidth if r["threads"] == threads] or bandwidth
    read_bw = max(r["read"] for r in here)
    dram_bw = max(r.get("best", r["read"]) for r in here)   # the step is held to the best kernel's
    time_decode_steps(llm, 1, context, 4, token_ids)  # warm-up: first calls allocate and compile
    rows = []
    for batch in progress_bar(batches, "roofline", progress):
        times = time_decode_steps(llm, batch, context, steps, token_ids)
        step = statistics.median(times)
        kv = batch * (context + steps // 2) * per_token  # each step attends the cache as it is then
        gbs = (weights + kv) / step / 1e9
        rows.append({"batch": batch, "context": context, "step_ms": 1e3 * step, "tok_s": batch / step,
                     "weight_mb": weights / 1e6, "kv_mb": kv / 1e6, "gb_s": gbs, "share": gbs / dram_bw})
    base = rows[0]["step_ms"] if rows else 1.0
    for r in rows:
        r["vs_batch_1"] = r["step_ms"] / base
    bend = next((r["batch"] for r in rows if r["vs_batch_1"] > 1.3), None)
    return {"workload": "roofline", "bandwidth": bandwidth, "read_gb_s": read_bw, "dram_gb_s": dram_bw, "rows": rows,
            "bend_batch": bend, "weight_bytes": weights, "kv_bytes_per_token": per_token}


def roofline_table(raw: dict) -> str:
    kernels = [k for k in ("read", "copy", "scale", "add", "triad", "best") if k in raw["bandwidth"][0]]
    bw = table(["threads", *(f"{k} GB/s" for k in kernels)],
               [[r["threads"], *(f"{r[k]:.1f}" for k in kernels)] for r in raw["bandwidth"]])
    steps = table(["batch", "context", "step ms", "tok/s", "weights MB", "KV MB", "GB/s", "share of DRAM bw",
                   "step vs batch 1"],
                  [[r["batch"], r["context"], f"{r['step_ms']:.2f}", f"{r['tok_s']:.1f}", f"{r['weight_mb']:.1f}",
                    f"{r['kv_mb']:.1f}", f"{r['gb_s']:.1f}", f"{100 * r['share']:.0f}%", f"{r['vs_batch_1']:.2f}x"]
                   for r in raw["rows"]])
    bend = raw["bend_batch"]
    note = (f"Step time first grows past 1.3x batch 1's at batch {bend}." if bend else
            "Step time stays within 1.3x of batch 1's at every batch measured.")
    dram = raw.get("dram_gb_s", raw["read_gb_s"])
    return (f"Machine bandwidth (STREAM's kernels on initialized float32 arrays of "
            f"{raw['bandwidth'][0].get('array_mb', '?')} MB):\n\n{bw}\n\nDecode steps (DRAM bandwidth, the best "
            f"kernel's at this thread count: {dram:.1f} GB/s):\n\n{steps}\n\n{note}")
