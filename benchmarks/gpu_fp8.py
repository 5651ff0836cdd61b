"""FP8 on a CUDA GPU: the compiled paths against their references, then timings.

Checks (every CUDA GPU; native FP8 matmuls only where compute capability >= 8.9):
- the Triton paged-attention kernels over fp8 pools (e4m3, e5m2; fp16 and bf16 queries;
  decodes and mixed prefill batches) against `paged_attention_ref`, and the e4m3
  byte-decoding path that GPUs before sm_89 take, forced on this one;
- `write_kv` on the GPU stores the same bytes as the CPU's clamp-then-cast;
- `Fp8Linear`'s native `torch._scaled_mm` path against its CPU-exact emulation;
- the engine with an FP8 cache: Triton kernels against the torch path, greedy tokens.

Timings (CUDA events, medians): fp8 vs bf16 matmuls at a few shapes, paged decode
attention over fp8 vs bf16 pools at a few batch sizes, and engine decode throughput of
the bundled model with FP8 KV / FP8 weights / both vs bf16. On a machine without CUDA it
says so and exits 0.

    python benchmarks/gpu_fp8.py                 # everything
    python benchmarks/gpu_fp8.py --quick         # fewer shapes
    python benchmarks/gpu_fp8.py --out benchmarks/results/gpu_fp8.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def table(head: list[str], rows: list[list]) -> None:
    say("| " + " | ".join(head) + " |")
    say("|" + "---|" * len(head))
    for r in rows:
        say("| " + " | ".join(str(c) for c in r) + " |")
    say()


def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---- paged attention over fp8 pools -----------------------------------------------------------

def fp8_batch(seq_lens, query_lens, fp8, qdtype, *, num_kv_heads=2, group=2, head_dim=128,
              block_size=16, seed=0):
    """Scattered blocks, keys and values written through `write_kv` with calibrated scales."""
    from llmopt.fp8 import per_tensor_scale
    from llmopt.kernels import paged_attention as pa

    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=fp8, device="cuda")
    v_cache = torch.zeros(shape, dtype=fp8, device="cuda")
    order = torch.randperm(num_blocks, generator=g, device="cuda").int()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    used, slots, ks, vs = 0, [], [], []
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :nb] = order[used:used + nb]
        used += nb
        pos = torch.arange(n, device="cuda")
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
        ks.append(torch.randn(n, num_kv_heads, head_dim, generator=g, device="cuda") * 4)
        vs.append(torch.randn(n, num_kv_heads, head_dim, generator=g, device="cuda"))
    k, v = torch.cat(ks), torch.cat(vs)
    k_scale, v_scale = per_tensor_scale(k, fp8).item(), per_tensor_scale(v, fp8).item()
    pa.write_kv(k, v, k_cache, v_cache, torch.cat(slots), k_scale, v_scale)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g, device="cuda").to(qdtype)
    qsl = torch.tensor([0] + list(query_lens), device="cuda").cumsum(0).int()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, query_start_loc=qsl,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale)


def check_attention(quick: bool) -> int:
    from llmopt.kernels import paged_attention as pa

    batches = {"decode": ([1, 7, 32, 45, 300], [1] * 5), "mixed": ([19, 33, 9, 1, 200], [19, 12, 1, 1, 150])}
    shapes = [(8, 1, 128), (16, 4, 64), (32, 3, 128)] if not quick else [(16, 4, 128)]
    native_e4m3 = pa.triton_has_e4m3(torch.device("cuda"))
    failures, rows = 0, []
    for name, fp8 in FP8.items():
        for qdtype in (torch.float16, torch.bfloat16):
            for block_size, group, head_dim in shapes:
                for kind, (seq_lens, query_lens) in batches.items():
                    b = fp8_batch(seq_lens, query_lens, fp8, qdtype, group=group, head_dim=head_dim,
                                  block_size=block_size)
                    ref = pa.paged_attention_ref(**b).float()
                    paths = {"native" if (fp8 != torch.float8_e4m3fn or native_e4m3) else "bytes": False}
                    if fp8 == torch.float8_e4m3fn and native_e4m3:
                        paths["bytes (forced)"] = True
                    for path, force_bytes in paths.items():
                        saved = pa.triton_has_e4m3
                        if force_bytes:
                            pa.triton_has_e4m3 = lambda device: False
                        try:
                            out = pa.paged_attention(**b).float()
                        finally:
                            pa.triton_has_e4m3 = saved
                        err = (out - ref).abs().max().item()
                        ok = torch.allclose(out, ref, atol=TOL[qdtype], rtol=TOL[qdtype]) and not out.isnan().any()
                        failures += not ok
                        rows.append([name, str(qdtype).removeprefix("torch."), block_size, group, head_dim,
                                     kind, path, f"{err:.2e}", "ok" if ok else "FAIL"])
    say(f"### Paged attention over fp8 pools, compiled (Triton e4m3 type on this GPU: {native_e4m3})\n")
    table(["fp8", "q dtype", "block", "group", "head dim", "batch", "e4m3 load", "max |err|", ""], rows)
    return failures


def check_write_kv() -> int:
    """The GPU's clamp-then-cast gives the CPU's bytes (round to nearest even, no NaN/inf)."""
    from llmopt.kernels import paged_attention as pa

    failures = 0
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * 50, torch.tensor([1e9, -1e9, 0.0, -0.0, 3e-6])])
    x = x.view(-1, 1, 1).expand(-1, 1, 16).contiguous()
    for name, fp8 in FP8.items():
        cpu_k, cpu_v = torch.zeros(x.shape[0], 1, 1, 16, dtype=fp8), torch.zeros(x.shape[0], 1, 1, 16, dtype=fp8)
        gpu_k, gpu_v = cpu_k.cuda(), cpu_v.cuda()
        slots = torch.arange(x.shape[0])
        pa.write_kv(x, x, cpu_k, cpu_v, slots, 0.3, 1.0)
        pa.write_kv(x.cuda(), x.cuda(), gpu_k, gpu_v, slots.cuda(), 0.3, 1.0)
        same = torch.equal(cpu_k.view(torch.uint8), gpu_k.cpu().view(torch.uint8)) and \
            torch.equal(cpu_v.view(torch.uint8), gpu_v.cpu().view(torch.uint8))
        finite = torch.isfinite(gpu_k.float()).all().item() and torch.isfinite(gpu_v.float()).all().item()
        failures += not (same and finite)
        say(f"- write_kv {name}: GPU bytes == CPU bytes: {same}; all finite: {finite}")
    say()
    return failures


def check_fp8_linear() -> int:
    from llmopt.fp8 import native_fp8_supported, per_token_scale, quantize_fp8

    try:
        from llmopt.layers.linear import Fp8Linear
    except ImportError as e:
        say(f"- Fp8Linear not available in this install ({e}); skipped\n")
        return 0
    if not native_fp8_supported("cuda"):
        say(f"- native FP8 matmul: not on this GPU (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))} < 8.9); Fp8Linear emulates\n")
        return 0
    failures = 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in [(1, 4096, 4096), (37, 1024, 3072), (512, 4096, 1024)]:
            dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
            layer = Fp8Linear.from_linear(dense)
            x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
            s = per_token_scale(x)
            xq = quantize_fp8(x, s)
            native = layer._native(xq, s, dtype).float()
            emulated = layer._emulated(xq, s).float()
            full = (x.float() @ dense.weight.float().t())
            rel = ((native - emulated).norm() / emulated.norm()).item()
            rel_full = ((native - full).norm() / full.norm()).item()
            ok = rel < 1e-2 and rel_full < 0.1
            failures += not ok
            say(f"- Fp8Linear {str(dtype).removeprefix('torch.')} [{m}x{k}] @ [{k}x{n}]: native vs emulated "
                f"rel err {rel:.1e}, vs full precision {rel_full:.1e} {'ok' if ok else 'FAIL'}")
    say()
    return failures


def check_engine() -> int:
    from llmopt import LLM, SamplingParams

    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef main():"]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm = LLM(model="tiny", device="cuda", dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True)
    cache = llm.llm_engine.kv_cache
    assert cache.use_triton, "the engine should use the Triton kernels on CUDA"
    triton_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    cache.use_triton = False
    torch_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    same = sum(a == b for x, y in zip(triton_tokens, torch_tokens) for a, b in zip(x, y))
    total = sum(map(len, torch_tokens))
    say(f"- engine, FP8 e4m3 KV (calibrated), fp32 model: Triton kernels vs torch path greedy tokens "
        f"identical {same}/{total}")
    say()
    return int(same < 0.9 * total)


# ---- timings -----------------------------------------------------------------------------------

def time_matmuls(quick: bool) -> None:
    from llmopt.fp8 import native_fp8_supported, per_channel_scale, per_token_scale, quantize_fp8

    say("### Matmul: fp8 (torch._scaled_mm, per-token x per-channel scales) vs bf16\n")
    if not native_fp8_supported("cuda"):
        say("No native FP8 matmul on this GPU (compute capability < 8.9).\n")
        return
    shapes = [(1, 4096, 4096), (16, 4096, 4096), (256, 4096, 4096), (4096, 4096, 4096), (4096, 8192, 8192)]
    rows = []
    for m, k, n in shapes[:3] if quick else shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ws = per_channel_scale(w)
        wq = quantize_fp8(w, ws)
        bf16 = cuda_time(lambda: x @ w.t())

        def fp8_mm():  # the activation quantization is part of the cost
            s = per_token_scale(x)
            return torch._scaled_mm(quantize_fp8(x, s), wq.t(), scale_a=s, scale_b=ws.t().contiguous(),
                                    out_dtype=torch.bfloat16)
        s = per_token_scale(x)
        xq = quantize_fp8(x, s)
        gemm_only = cuda_time(lambda: torch._scaled_mm(xq, wq.t(), scale_a=s, scale_b=ws.t().contiguous(),
                                                       out_dtype=torch.bfloat16))
        full = cuda_time(fp8_mm)
        tflops = lambda ms: 2 * m * k * n / ms / 1e9  # noqa: E731
        rows.append([f"{m}x{k} @ {k}x{n}", f"{bf16:.3f}", f"{gemm_only:.3f}", f"{full:.3f}",
                     f"{bf16 / gemm_only:.2f}x", f"{bf16 / full:.2f}x", f"{tflops(bf16):.0f} / {tflops(gemm_only):.0f}"])
    table(["shape", "bf16 ms", "fp8 GEMM ms", "fp8 incl. quantizing x ms", "GEMM speedup", "speedup incl. quant",
           "TFLOP/s bf16 / fp8"], rows)


def time_decode_attention(quick: bool) -> None:
    from llmopt.kernels import paged_attention as pa

    say("### Paged decode attention: fp8 pool vs bf16 pool (8 KV heads x 128, GQA 4, block 16)\n")
    rows = []
    for batch in [1, 8, 32, 128] if not quick else [1, 32]:
        for ctx in [1024, 4096] if not quick else [2048]:
            b8 = fp8_batch([ctx] * batch, [1] * batch, torch.float8_e4m3fn, torch.bfloat16,
                           num_kv_heads=8, group=4, head_dim=128, block_size=16)
            b16 = dict(b8, k_cache=(b8["k_cache"].float() * b8["k_scale"]).to(torch.bfloat16),
                       v_cache=(b8["v_cache"].float() * b8["v_scale"]).to(torch.bfloat16),
                       k_scale=1.0, v_scale=1.0)
            run = lambda b: pa.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["block_tables"],  # noqa: E731
                                                     b["seq_lens"], b["scale"], k_scale=b["k_scale"],
                                                     v_scale=b["v_scale"])
            t16, t8 = cuda_time(lambda: run(b16)), cuda_time(lambda: run(b8))
            kv_bytes = 2 * batch * ctx * 8 * 128
            rows.append([batch, ctx, f"{t16:.3f}", f"{t8:.3f}", f"{t16 / t8:.2f}x",
                         f"{2 * kv_bytes / t16 / 1e6:.0f} / {kv_bytes / t8 / 1e6:.0f}"])
    table(["batch", "context", "bf16 pool ms", "fp8 pool ms", "speedup", "KV GB/s read bf16 / fp8"], rows)


def time_engine(quick: bool) -> None:
    from llmopt import LLM, SamplingParams

    say("### Engine decode throughput, bundled `tiny` model (bf16 on the GPU)\n")
    say("The tiny model (384 wide) is far too small for FP8 matmuls to pay; this shows the engine runs "
        "each path and what the KV bytes buy at batch sizes that stress memory less than a real model.\n")
    configs = [("bf16", {}), ("KV fp8 e4m3", dict(kv_cache_dtype="fp8", calculate_kv_scales=True)),
               ("weights fp8", dict(quantization="fp8")),
               ("both", dict(quantization="fp8", kv_cache_dtype="fp8", calculate_kv_scales=True))]
    rows = []
    for name, kw in configs:
        try:
            llm = LLM(model="tiny", device="cuda", gpu_memory_utilization=0.1, **kw)
        except (ValueError, TypeError) as e:
            rows.append([name, "-", "-", f"not run: {e}"])
            continue
        for batch in [1, 16, 64] if not quick else [16]:
            prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            rows.append([name, batch, f"{llm.llm_engine.num_blocks:,}", f"{batch * 128 / dt:,.0f}"])
        del llm
        torch.cuda.empty_cache()
    table(["configuration", "batch", "KV blocks in the budget", "generated tokens/s"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the report as markdown here")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("No CUDA device: this script checks and times the compiled FP8 paths on a GPU. "
              "On CPU, run the tests instead (TRITON_INTERPRET=1 runs the same kernels).")
        return 0
    from llmopt.kernels import HAS_TRITON

    if not HAS_TRITON:
        print("Triton is not installed; the kernels cannot run.")
        return 1
    cc = torch.cuda.get_device_capability()
    say(f"# FP8 on {torch.cuda.get_device_name()} (compute capability {cc[0]}.{cc[1]}), "
        f"torch {torch.__version__}\n")
    say("## Checks\n")
    failures = check_attention(args.quick) + check_write_kv() + check_fp8_linear() + check_engine()
    say(f"**{failures} check(s) failed.**\n" if failures else "All checks passed.\n")
    say("## Timings (CUDA events, median of 20)\n")
    time_matmuls(args.quick)
    time_decode_attention(args.quick)
    time_engine(args.quick)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(LINES) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
