"""The C++ CPU kernels against what they replace, each figure with the GB/s it reads at.

GGUF blocks (Q8_0 / Q4_0 / Q4_1, llama.cpp's int8-activation arithmetic) against torch's dense
bf16 matmul, and the compiled decode step's own bf16 kernels beside it (dense_matmul.cpp's rows,
and the 32-row panels of dense_panels.cpp where the CPU has AVX-512), at 1 / 4 / 16 / 64 rows of x, on SmolLM2-135M's shapes; paged attention against
the engine's torch path (gather into a padded batch, then SDPA) at batch 1 / 8 / 64 and
context 128 / 512 / 2048, SmolLM2's heads (9 query, 3 kv, head_dim 64, bf16). GB/s is the
bytes a call must read (the weights; the keys and values) over its time; the header gives
the machine's read bandwidth (a sum over 1 GiB of initialized memory) to compare with.

    python benchmarks/cpu_kernels.py [--threads 2] [--repeats 50]
    python benchmarks/cpu_kernels.py --sections streamed --out benchmarks/results/cpu_kernels_streamed

`--sections streamed`: the GGUF row kernels where a decode step meets them beyond the cache: four
layers of the Llama-3.2-1B shape (random blocks, 137-258 MB, several times any last-level cache),
called in turn as a step calls them, at 1 and 8 rows of x; GB/s against the DRAM bandwidth measured
as STREAM does (llmopt.bench.roofline) at the same thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from llmopt.layers.attention import AttentionMetadata
from llmopt.layers.paged_attention import paged_attention_torch
from llmopt.worker.kv_cache import PagedKVCache
from llmopt.kernels import cpu
from llmopt.kernels.cpu.gguf_blocks import GGUFBlockWeight
from llmopt.kernels.cpu.paged_attention import paged_attention_cpu

RESULTS = Path(__file__).parent / "results"
# SmolLM2-135M: (name, out_features N, in_features K); gate and up run fused
SHAPES = [("qkv / o 576x576", 576, 576), ("gate_up 3072x576", 3072, 576), ("down 576x1536", 576, 1536),
          ("head 49152x576", 49152, 576)]
ROWS = (1, 4, 16, 64)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# Llama-3.2-1B's four matmuls of a layer (qkv, o, gate_up, down), four layers of them
STREAMED = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * 4


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def read_bandwidth() -> float:
    """GB/s of a sum over 1 GiB of written (not merely allocated) memory, best of 5."""
    x = torch.ones(2 ** 28)
    return x.numel() * 4 / min(timed(lambda: x.sum(), 1) for _ in range(5)) / 1e9


def matmul_rows(repeats: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        dense = torch.from_numpy(w).bfloat16()
        panels = cpu.dense_panels(dense)  # None without AVX-512
        blocks = {t: GGUFBlockWeight.from_gguf_bytes(quantize(w, GGMLQuantizationType[t]), t, k)
                  for t in ("Q8_0", "Q4_0", "Q4_1")}
        reps = max(5, repeats // (8 if n > 10000 else 1))
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            t_dense = timed(lambda: F.linear(x, dense), reps)
            t_mv = timed(lambda: cpu.load().dense_matmul(x, dense), reps)
            t_panels = timed(lambda: cpu.load().dense_matmul(x, panels), reps) if panels is not None else float("nan")
            row = {"shape": name, "rows": m, "bf16_us": t_dense * 1e6,
                   "bf16_GBps": dense.numel() * 2 / t_dense / 1e9, "bf16_kernel_us": t_mv * 1e6,
                   "bf16_kernel_GBps": dense.numel() * 2 / t_mv / 1e9, "bf16_panels_us": t_panels * 1e6,
                   "bf16_panels_GBps": dense.numel() * 2 / t_panels / 1e9}
            for t, b in blocks.items():
                s = timed(lambda: b.matmul(x), reps)
                row[f"{t}_us"], row[f"{t}_GBps"], row[f"{t}_speedup"] = s * 1e6, b.nbytes() / s / 1e9, t_dense / s
            rows.append(row)
    return rows


def crossover_rows(repeats: int) -> list[dict]:
    """Where a prompt's many rows make the dense matmul win (gate_up, the largest layer)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3072, 576)) * 0.05).astype(np.float32)
    q8 = GGUFBlockWeight.from_gguf_bytes(quantize(w, GGMLQuantizationType.Q8_0), "Q8_0", 576)
    dense = {dt: torch.from_numpy(w).to(dt) for dt in (torch.float32, torch.bfloat16)}
    rows = []
    for m in (16, 32, 64, 128, 512):
        row = {"rows": m}
        for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            x = torch.randn(m, 576).to(dt)
            row[f"{name}_dense_us"] = timed(lambda: F.linear(x, dense[dt]), max(5, repeats // 5)) * 1e6
            row[f"{name}_Q8_0_us"] = timed(lambda: q8.matmul(x), max(5, repeats // 5)) * 1e6
        rows.append(row)
    return rows


def streamed_rows(repeats: int) -> list[dict]:
    """Each GGUF type's row kernel over STREAMED's weights in turn (no weight is met twice before
    the others have passed through the cache), at 1 and 8 rows of x: the best of `repeats` passes."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        per_block = 32 if kind == "Q8_0" else 16
        scales = lambda n, k: (torch.rand(n, k // 32, generator=gen) * 0.01).half()  # noqa: E731
        weights = [GGUFBlockWeight(kind, torch.randint(0, 256, (n, k // 32, per_block), dtype=torch.uint8,
                                                       generator=gen),
                                   scales(n, k), -scales(n, k) if kind == "Q4_1" else None)
                   for n, k in STREAMED]
        nbytes = sum(w.nbytes() for w in weights)
        for rows in (1, 8):
            xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in STREAMED}}
            step = lambda: [w.matmul(xs[w.in_features]) for w in weights]  # noqa: E731
            step()
            times = []
            for _ in range(max(repeats // 2, 5)):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            best = min(times)
            out.append({"type": kind, "rows": rows, "MB": nbytes / 1e6, "ms": best * 1e3,
                        "median_ms": float(np.median(times)) * 1e3, "GBps": nbytes / best / 1e9})
    return out


def streamed_markdown(info: dict, rows: list[dict]) -> str:
    bw = info["dram"]
    lines = ["# GGUF row kernels beyond the cache: four Llama-3.2-1B layers (llmopt/kernels/cpu)", "",
             f"{info['cpu']}, {info['threads']} threads, vector ISA {info['simd']}, last-level cache "
             f"{info['llc_mib']:.0f} MiB, torch {info['torch']}; load average {info['load'][0]:.2f} before, "
             f"{info['load'][1]:.2f} after. DRAM bandwidth as STREAM measures it ({bw['threads']} threads, "
             f"{bw['array_mb']} MB arrays, best kernel): **{bw['best']:.1f} GB/s**. Each pass calls the 16 "
             "weights in turn (qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192, four times), "
             "best of the passes (and their median); GB/s = the blocks' bytes / the best pass's time.", "",
             "| type | rows of x | MB | ms, best (median) | GB/s (share of DRAM) | time / 1 row's |",
             "|---|---|---|---|---|---|"]
    one = {r["type"]: r["ms"] for r in rows if r["rows"] == 1}
    for r in rows:
        lines.append(f"| {r['type']} | {r['rows']} | {r['MB']:.0f} | {r['ms']:.1f} ({r['median_ms']:.1f}) | "
                     f"{r['GBps']:.1f} ({r['GBps'] / bw['best']:.0%}) | {r['ms'] / one[r['type']]:.2f}x |")
    return "\n".join(lines) + "\n"


def attention_case(batch: int, context: int, dtype=torch.bfloat16):
    """A decode step: `batch` sequences of `context` cached tokens plus one new one each."""
    per_seq = -(-(context + 1) // BLOCK)
    num_blocks = batch * per_seq
    cache = PagedKVCache(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype)
    cache.k[0].normal_(), cache.v[0].normal_()
    order = torch.randperm(num_blocks).view(batch, per_seq)
    lens = [context + 1] * batch
    b = AttentionMetadata.paged(order.tolist(), [context] * batch, [1] * batch, BLOCK)
    assert b.seq_lens == lens
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM).to(dtype)
    return cache, b, q, k, v


def attention_rows(repeats: int) -> list[dict]:
    rows = []
    for batch in (1, 8, 64):
        for context in (128, 512, 2048):
            cache, b, q, k, v = attention_case(batch, context)
            scale = HEAD_DIM ** -0.5
            kv_bytes = 2 * batch * (context + 1) * KV_HEADS * HEAD_DIM * 2
            torch_path = timed(lambda: paged_attention_torch(q, k, v, b, cache, 0, scale), repeats)
            kernel = timed(lambda: paged_attention_cpu(q, cache.k[0], cache.v[0], b.block_table_tensor,
                                                       b.query_start_loc, b.seq_lens_tensor, scale), repeats)
            rows.append({"batch": batch, "context": context, "torch_us": torch_path * 1e6,
                         "torch_GBps": kv_bytes / torch_path / 1e9, "kernel_us": kernel * 1e6,
                         "kernel_GBps": kv_bytes / kernel / 1e9, "speedup": torch_path / kernel})
    return rows


def markdown(info: dict, mm: list[dict], cross: list[dict], att: list[dict]) -> str:
    lines = ["# CPU kernels: GGUF blocks and paged attention (llmopt/kernels/cpu)", "",
             f"{info['cpu']}, {info['threads']} threads, vector ISA {info['simd']}, torch {info['torch']}; "
             f"load average {info['load'][0]:.2f} before, {info['load'][1]:.2f} after. Read bandwidth "
             f"(sum over 1 GiB): **{info['read_GBps']:.1f} GB/s**. "
             + (f"First build of the kernels: {info['build_s']:.0f} s here; " if info['build_s'] == info['build_s']
                else "The kernels were built before this run (set BUILD_S to record a build's time); ")
             + f"later processes load them in {info['load_s'] * 1e3:.0f} ms. "
             "Medians of repeated calls; GB/s = bytes the call must read / its time.", "",
             "## x @ W^T: GGUF blocks (int8 activations, llama.cpp's arithmetic) vs dense bf16", "",
             "bf16 = torch's matmul; bf16 rows = dense_matmul.cpp's row kernel (what the compiled step uses "
             "for bf16 weights up to 8 rows of x without AVX-512); bf16 panels = the weight repacked into panels "
             "of 32 rows (dense_panels.cpp, what it uses at any number of rows on an AVX-512 CPU); speedups are "
             "the blocks' against torch's bf16. One weight called again and again stays in this CPU's caches "
             "(576 x 576 in bf16 is 0.7 MB), so the small shapes can read above the memory's bandwidth; a whole "
             "decode step's figures are in roofline.md.", "",
             "| shape (N x K) | rows | bf16 us (GB/s) | bf16 rows us (GB/s) | bf16 panels us (GB/s) | Q8_0 us (GB/s) |"
             " Q4_0 us (GB/s) | Q4_1 us (GB/s) | Q8_0 / Q4_0 / Q4_1 speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for r in mm:
        cells = [f"{r[f'{t}_us']:,.0f} ({r[f'{t}_GBps']:.1f})" if r[f"{t}_us"] == r[f"{t}_us"] else "-"
                 for t in ("bf16", "bf16_kernel", "bf16_panels", "Q8_0", "Q4_0", "Q4_1")]
        lines.append(f"| {r['shape']} | {r['rows']} | " + " | ".join(cells) +
                     f" | {r['Q8_0_speedup']:.2f}x / {r['Q4_0_speedup']:.2f}x / {r['Q4_1_speedup']:.2f}x |")
    lines += ["", "## Where the dense matmul takes over (gate_up 3072x576, Q8_0 kernel vs dense, us)", "",
              "| rows | fp32 dense | Q8_0, fp32 x | bf16 dense | Q8_0, bf16 x |", "|---|---|---|---|---|"]
    for r in cross:
        lines.append(f"| {r['rows']} | {r['fp32_dense_us']:,.0f} | {r['fp32_Q8_0_us']:,.0f} | "
                     f"{r['bf16_dense_us']:,.0f} | {r['bf16_Q8_0_us']:,.0f} |")
    lines += ["", "## Paged decode attention: C++ kernel vs the torch path (gather + SDPA), bf16 pool", "",
              "SmolLM2's heads: 9 query heads on 3 kv heads, head_dim 64, blocks of 16, one layer.", "",
              "| batch | context | torch us (GB/s) | kernel us (GB/s) | speedup |", "|---|---|---|---|---|"]
    for r in att:
        lines.append(f"| {r['batch']} | {r['context']} | {r['torch_us']:,.0f} ({r['torch_GBps']:.1f}) | "
                     f"{r['kernel_us']:,.0f} ({r['kernel_GBps']:.1f}) | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=str(RESULTS / "cpu_kernels"), help="writes OUT.md and OUT.json")
    p.add_argument("--sections", choices=["cache", "streamed"], default="cache",
                   help="cache: SmolLM2's shapes and attention (the default); streamed: 1B layers from DRAM")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t = time.perf_counter()
    if not cpu.available():
        raise SystemExit(f"the C++ CPU kernels are not available: {cpu.why_unavailable()}")
    load_s = time.perf_counter() - t
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in model.splitlines() if "Model name" in line),
                 platform.processor())
    info = {"cpu": model, "threads": args.threads, "simd": cpu.load().simd(), "torch": torch.__version__,
            "read_GBps": read_bandwidth(), "load_s": load_s, "build_s": float(os.environ.get("BUILD_S", "nan"))}
    if args.sections == "streamed":
        from llmopt.bench.common import llc_bytes
        from llmopt.bench.roofline import measure_bandwidth

        info.update(dram=measure_bandwidth((args.threads,))[0], llc_mib=(llc_bytes() or 0) / 2**20)
        results = {"streamed": streamed_rows(args.repeats)}
    else:
        results = {"matmul": matmul_rows(args.repeats), "crossover": crossover_rows(args.repeats),
                   "attention": attention_rows(args.repeats)}
    info["load"] = (load_before[0], os.getloadavg()[0])
    text = (streamed_markdown(info, results["streamed"]) if args.sections == "streamed" else
            markdown(info, results["matmul"], results["crossover"], results["attention"]))
    print(text)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({"info": info, **results}, indent=1))


if __name__ == "__main__":
    main()
