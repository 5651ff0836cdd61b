"""The kernel sections of gpu_check.py: every Triton kernel against its torch reference, then timed.

`section_kernels` compiles each kernel on the shapes the engine gives it and holds it to its
reference: paged attention (decode and prefill kernels) over bf16, fp16 and fp8 (e4m3, e5m2)
pools, block sizes 16 and 32, GQA groups 1 to 8 on head_dim 64 (SmolLM2's 9 query heads on 3
KV heads among them), scattered blocks, mixed prefill / decode batches and a sliding window;
the e4m3 byte-decoding path older GPUs take, forced; `write_kv`'s fp8 bytes against the CPU's;
W4A16 in the GPTQ (with and without act-order) and AWQ layouts on SmolLM2's linear shapes; the
decode step's fused elementwise kernels (residual add + RMSNorm, RoPE, SiLU-and-multiply); and FP8 linears' native `_scaled_mm` path against its exact emulation.

`section_kernel_timings` times them (CUDA events, medians): decode attention over bf16 and
fp8 pools as a share of the copy bandwidth (and, at an 8B layer's 64 x 2,048, with 16 to 128
keys a tile), and bf16 / W4A16 (tinygemm and Triton) / FP8 (W8A16 and W8A8) matmuls as shares of
the bf16 matmul rate and the bandwidth. In the dry run each is called once and not timed.
"""

from __future__ import annotations

import torch

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# SmolLM2-135M: hidden 576, 9 heads of 64 on 3 KV heads, MLP 1536; fused q/k/v is 960 wide,
# fused gate/up 3072 (the engine's layout)
SMOLLM2_LINEARS = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072),
                   "down_proj": (1536, 576)}
# what the dry run gives the interpreter (it runs every program in numpy)
TINY_LINEARS = {"qkv_proj": (128, 192), "down_proj": (192, 64)}


def paged_batch(run, seq_lens, query_lens, *, num_kv_heads, group, head_dim, block_size, dtype,
                cache_dtype=None, seed=0):
    """A pool with each sequence's blocks scattered over it (unowned slots hold NaN, so a read of
    a wrong slot shows), keys and values written through `write_kv`, and the flat queries."""
    from llmopt.fp8.format import per_tensor_scale
    from llmopt.worker.kv_cache import write_kv

    dev = run.device
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=dev).manual_seed(seed)  # the large tensors are drawn where they live
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = 0.0 if cache_dtype in FP8.values() else float("nan")
    k_cache = torch.full(shape, fill, device=dev).to(cache_dtype)
    v_cache = torch.full(shape, fill, device=dev).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=g).int()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :nb] = order[used:used + nb]
        used += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    total = sum(seq_lens)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gd, device=dev) * 2
    v = torch.randn(total, num_kv_heads, head_dim, generator=gd, device=dev)
    k_scale = v_scale = 1.0
    if cache_dtype in FP8.values():
        k_scale, v_scale = per_tensor_scale(k, cache_dtype).item(), per_tensor_scale(v, cache_dtype).item()
    else:
        k, v = k.to(dtype), v.to(dtype)
    write_kv(k, v, k_cache, v_cache, torch.cat(slots).to(dev), k_scale, v_scale)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gd, device=dev).to(dtype)
    qsl = torch.tensor([0] + list(query_lens)).cumsum(0).int().to(dev)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables.to(dev), query_start_loc=qsl,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), scale=head_dim ** -0.5,
                k_scale=k_scale, v_scale=v_scale)


def attention_cases(run) -> list[tuple]:
    """(label, q dtype, cache dtype, block size, group): block sizes x groups 1, 3, 4, 8 in bf16 on
    head_dim 64, then fp16 and the fp8 pools on groups 1, 3, 8."""
    bf16 = run.bf16
    if run.dry_run:  # each kind once: fp16 standing in for bf16, and both fp8 pools
        return [("fp16 (for bf16)", bf16, bf16, 16, 3), ("fp16 (for bf16)", bf16, bf16, 32, 8),
                ("fp8 e4m3", bf16, FP8["e4m3"], 16, 3), ("fp8 e5m2", bf16, FP8["e5m2"], 32, 1)]
    # groups 1, 3 (SmolLM2), 4 (Llama-3-8B) and 8: each a compile, so the sweep stops at those
    cases = [("bf16", bf16, bf16, bs, g) for bs in (16, 32) for g in (1, 3, 4, 8)]
    cases += [("fp16", torch.float16, torch.float16, bs, g) for bs in (16, 32) for g in (1, 3, 8)]
    cases += [(f"fp8 {name}", bf16, fp8, bs, g) for name, fp8 in FP8.items() for bs in (16, 32) for g in (1, 3, 8)]
    # SmolLM2's group first for every kind, then groups 1 and 8, then the rest: if compiling takes
    # longer than the budget, what is left out is the least informative
    return sorted(cases, key=lambda c: {3: 0, 1: 1, 8: 1}.get(c[4], 2))


def check_paged_attention(run) -> None:
    from llmopt.kernels import paged_attention as pa

    if run.dry_run:  # the interpreter runs every program in numpy: few and short sequences
        batches = {"decode": ([1, 17, 40], [1, 1, 1]), "mixed": ([19, 33, 1], [19, 12, 1])}
    else:
        batches = {"decode": ([1, 7, 32, 45, 300, 1000], [1] * 6),
                   "mixed": ([19, 33, 9, 1, 200, 700], [19, 12, 1, 1, 150, 64])}
    native_e4m3 = pa.triton_has_e4m3(torch.device(run.device))
    rows, worst = [], {}
    for label, dtype, cache_dtype, block_size, group in attention_cases(run):
        if not run.has_time(5):
            break
        for kind, (seq_lens, query_lens) in batches.items():
            b = paged_batch(run, seq_lens, query_lens, num_kv_heads=3 if group == 3 else 2, group=group,
                            head_dim=64, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype)
            for window in (None,) if run.dry_run else (None, 5):
                ref = pa.paged_attention_ref(**b, sliding_window=window).float()
                out = pa.paged_attention(**b, sliding_window=window).float()
                err = (out - ref).abs().max().item()
                ok = bool(torch.allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])) and not out.isnan().any()
                key = (label, block_size, group)
                worst[key] = max(worst.get(key, 0.0), err) if ok and worst.get(key) != "FAIL" else "FAIL"
                if not ok:
                    run.check(f"paged attention {label} block {block_size} group {group} {kind} window {window}",
                              False, f"max |err| {err:.2e}")
            if cache_dtype == torch.float8_e4m3fn and kind == "decode":
                # the byte-decoding path GPUs before sm_89 take, forced on this device
                saved, pa.triton_has_e4m3 = pa.triton_has_e4m3, (lambda device: False)
                try:
                    out = pa.paged_attention(**b).float()
                finally:
                    pa.triton_has_e4m3 = saved
                ref = pa.paged_attention_ref(**b).float()
                run.check(f"e4m3 from bytes, block {block_size} group {group}",
                          bool(torch.allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])),
                          f"max |err| {(out - ref).abs().max().item():.2e}")
    for (label, block_size, group), err in worst.items():
        rows.append([label, block_size, group, "SmolLM2 (9 on 3)" if group == 3 else "",
                     err if err == "FAIL" else f"{err:.1e}"])
    run.check("paged attention: every case equals the reference", all(r[-1] != "FAIL" for r in rows),
              f"{len(rows)} (dtype, block, group) cases x {len(batches)} batches; "
              f"Triton's e4m3 type here: {native_e4m3}")
    run.table("Paged attention, compiled, against paged_attention_ref (head_dim 64; decode and mixed batches"
              + ("" if run.dry_run else "; no window and a window of 5") + ")",
              ["q / pool", "block", "GQA group", "", "max |err|"], rows)


def check_fused_step(run) -> None:
    """The decode step's fused elementwise kernels (llmopt/kernels/fused_step.py) against their
    references, on SmolLM2's and Llama-3.1-8B's widths in the run's bf16, a few rows and many."""
    from llmopt.kernels import fused_step as fs
    from llmopt.layers.rotary import RotaryEmbedding

    dev, dtype, rows = run.device, run.bf16, []
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"tiny": (64, 4, 2, 16, 96)} if run.dry_run else {
        "SmolLM2": (576, 9, 3, 64, 1536), "Llama-3.1-8B": (4096, 32, 8, 128, 14336)}
    for name, (hidden, hq, hk, d, inter) in shapes.items():
        rope = RotaryEmbedding(d, 4096, 500000.0)
        cos, sin = rope.cos.to(dev), rope.signed_sin.to(dev)
        for T in (1, 3) if run.dry_run else (1, 8, 300):
            x, r = (torch.randn(T, hidden, generator=g, device=dev).to(dtype) for _ in range(2))
            w = torch.randn(hidden, generator=g, device=dev).to(dtype)
            qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g, device=dev).to(dtype)
            q, k = qkv[:, :hq * d].view(T, hq, d), qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
            pos = torch.randint(0, 4096, (T,), generator=g, device=dev)
            gu = (3 * torch.randn(T, 2 * inter, generator=g, device=dev)).to(dtype)
            pairs = [(fs.add_rms_norm(x, w, 1e-5, r), fs.add_rms_norm_ref(x, w, 1e-5, r)),
                     (fs.rotary(pos, q, k, cos, sin), fs.rotary_ref(pos, q, k, cos, sin)),
                     ((fs.silu_mul(gu),), (fs.silu_mul_ref(gu),))]
            for kernel, (got, want) in zip(("add_rms_norm", "rotary", "silu_mul"), pairs):
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                ok = all(torch.allclose(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype]) for a, b in zip(got, want))
                rows.append([kernel, name, T, f"{err:.1e}" if ok else "FAIL"])
    run.check("fused step kernels equal their references", all(r[-1] != "FAIL" for r in rows), f"{len(rows)} cases")
    run.table("The decode step's fused elementwise kernels against fused_step_ref", ["kernel", "widths", "rows",
                                                                                    "max |err|"], rows)


def check_write_kv(run) -> None:
    """An fp8 pool written on the device holds the CPU's bytes (clamp, round to nearest even)."""
    from llmopt.worker.kv_cache import write_kv

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * 50, torch.tensor([1e9, -1e9, 0.0, -0.0, 3e-6])])
    x = x.view(-1, 1, 1).expand(-1, 1, 16).contiguous()
    slots = torch.arange(x.shape[0])
    for name, fp8 in FP8.items():
        cpu = [torch.zeros(x.shape[0], 1, 1, 16, dtype=fp8) for _ in range(2)]
        dev = [c.to(run.device) for c in cpu]
        write_kv(x, x, *cpu, slots, 0.3, 1.0)
        write_kv(x.to(run.device), x.to(run.device), *dev, slots.to(run.device), 0.3, 1.0)
        same = all(torch.equal(c.view(torch.uint8), d.cpu().view(torch.uint8)) for c, d in zip(cpu, dev))
        finite = all(torch.isfinite(d.float()).all().item() for d in dev)
        run.check(f"write_kv {name}: device bytes == CPU bytes, all finite", same and finite)


def random_int4(K, N, group, act_order, seed=0):
    from llmopt.layers.quant.formats import QuantizedWeight

    g = torch.Generator().manual_seed(seed)
    g_idx = torch.arange(K) // group
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    return QuantizedWeight(torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32),
                           (torch.rand(K // group, N, generator=g) * 0.02 + 1e-3).half(),
                           torch.randint(1, 16, (K // group, N), generator=g, dtype=torch.int32),
                           g_idx.int(), 4, group)


def check_w4a16(run) -> None:
    from llmopt.kernels.quant_matmul import w4a16_matmul, w4a16_matmul_ref
    from llmopt.layers.quant.awq import to_awq
    from llmopt.layers.quant.gptq import to_gptq

    rows, all_ok = [], True
    for name, (K, N) in (TINY_LINEARS if run.dry_run else SMOLLM2_LINEARS).items():
        for layout, act_order in (("gptq", False), ("gptq", True), ("awq", False)):
            w = random_int4(K, N, 64, act_order, seed=K + N)
            t = {k: v.to(run.device) for k, v in (to_gptq if layout == "gptq" else to_awq)(w).items()}
            g_idx = t.get("g_idx") if act_order else None
            errs = []
            for dtype in sorted({run.bf16, torch.float16}, key=str):
                for M in ((1, 33) if run.dry_run else (1, 16, 33, 256)):
                    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(run.device, dtype)
                    got = w4a16_matmul(x, t["qweight"], t["qzeros"], t["scales"], g_idx, 64, layout)
                    want = w4a16_matmul_ref(x, t["qweight"], t["qzeros"], t["scales"], g_idx, 64, layout)
                    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    errs.append(rel)
            ok = max(errs) < 1e-2
            all_ok &= ok
            rows.append([f"{name} [{K} -> {N}]", layout + (" act-order" if act_order else ""),
                         f"{max(errs):.1e}", "ok" if ok else "FAIL"])
    run.check("W4A16 kernel equals dequantize-then-matmul (relative error < 1e-2)", all_ok)
    run.table("W4A16 (group 64), compiled, against w4a16_matmul_ref", ["linear", "layout",
              "worst relative error", ""], rows)


def check_fp8_linear(run) -> None:
    from llmopt.fp8.format import native_fp8_supported, per_token_scale, quantize_fp8
    from llmopt.fp8.linear import Fp8Linear

    native = native_fp8_supported(run.device)
    for K, N in (TINY_LINEARS if run.dry_run else SMOLLM2_LINEARS).values():
        dense = torch.nn.Linear(K, N, bias=False).to(run.device, run.bf16)
        layer = Fp8Linear.from_linear(dense)
        x = torch.randn(33, K, generator=torch.Generator().manual_seed(K)).to(run.device, run.bf16)
        s = per_token_scale(x)
        xq = quantize_fp8(x, s)
        emulated = layer._emulated(xq, s).float()
        full = x.float() @ dense.weight.float().t()
        path = layer._native(xq, s, run.bf16).float() if native else emulated
        rel = ((path - emulated).norm() / emulated.norm()).item()
        rel_full = ((path - full).norm() / full.norm()).item()
        run.check(f"Fp8Linear [{K} -> {N}] {'native _scaled_mm' if native else 'emulated'} vs emulation / "
                  "full precision", rel < 1e-2 and rel_full < 0.1, f"{rel:.1e} / {rel_full:.1e}")
    if not native:
        run.note("native FP8 matmul needs CUDA with compute capability >= 8.9; this run checked the emulation")
    check_fp8_weight_only(run)


def check_fp8_weight_only(run) -> None:
    """The W8A16 Triton kernel (decode batch sizes) against its reference, split-K as chosen and none."""
    from llmopt.fp8.format import per_channel_scale, quantize_fp8
    from llmopt.kernels.fp8_matmul import fp8_weight_matmul, fp8_weight_matmul_ref

    worst = 0.0
    for K, N in (TINY_LINEARS if run.dry_run else {**SMOLLM2_LINEARS, "8B": (4096, 14336)}).values():
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)).to(run.device) * 0.02
        ws = per_channel_scale(w)
        wq = quantize_fp8(w, ws)
        for M in (1, 16):
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(run.device, run.bf16)
            want = fp8_weight_matmul_ref(x, wq, ws).float()
            for split in (None, 1):
                got = fp8_weight_matmul(x, wq, ws, split=split).float()
                worst = max(worst, ((got - want).norm() / want.norm()).item())
    run.check("FP8 W8A16 kernel equals its reference (relative error < 1e-2)", worst < 1e-2, f"worst {worst:.1e}")


def section_kernels(run) -> None:
    for check in (check_write_kv, check_fused_step, check_w4a16, check_fp8_linear, check_paged_attention):
        if run.has_time(3):
            check(run)


# -- timings --------------------------------------------------------------------------------------------------
def section_kernel_timings(run) -> None:
    from llmopt.fp8.format import native_fp8_supported
    from llmopt.kernels import paged_attention as pa

    bw = run.ceilings["bandwidth_GBps"]
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    run.note("each time is one call's share of a CUDA graph replaying the call back to back (Run.timed): "
             "the kernel without its launch, median of replays")

    # decode attention: SmolLM2's heads, and a Llama-3-8B layer's (8 KV heads of 128, group 4)
    shapes = [("SmolLM2 3x64 g3", 3, 3, 64), ("8B 8x128 g4", 8, 4, 128)]
    sizes = [(2, 32)] if run.dry_run else [(1, 2048), (64, 512), (64, 2048), (256, 1024)]
    rows = []
    for label, kv_heads, group, head_dim in shapes:
        for batch, ctx in sizes:
            if not run.has_time(3):
                break
            timings = {}
            for name, cache in (("bf16", run.bf16), ("fp8", torch.float8_e4m3fn)):
                b = paged_batch(run, [ctx] * batch, [1] * batch, num_kv_heads=kv_heads, group=group,
                                head_dim=head_dim, block_size=16, dtype=run.bf16, cache_dtype=cache)
                timings[name] = run.timed(lambda b=b: pa.paged_attention_decode(
                    b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"],
                    k_scale=b["k_scale"], v_scale=b["v_scale"]))
                del b  # before the next pool is made: the largest are gigabytes
            kv = 2 * batch * ctx * kv_heads * head_dim  # elements of K and V read per call
            t16, t8 = timings["bf16"], timings["fp8"]
            gbs16 = None if t16 is None else 2 * kv / t16 / 1e6
            gbs8 = None if t8 is None else kv / t8 / 1e6
            rows.append([label, batch, ctx, fmt(t16), fmt(t8), fmt(gbs16, "{:.0f}"), fmt(gbs8, "{:.0f}"),
                         fmt(None if gbs16 is None else 100 * gbs16 / bw, "{:.0f}%"),
                         fmt(None if t8 is None else t16 / t8, "{:.2f}x")])
            if (label, batch, ctx) == ("8B 8x128 g4", 64, 2048) and t16 and t8:
                run.section.numbers["fp8kv_attention_speedup_8b_64x2048"] = t16 / t8
    run.table(f"Paged decode attention (block 16, {pa.DECODE_KEYS_PER_TILE} keys a tile): KV bytes read per "
              "second, as a share of the copy bandwidth",
              ["heads", "batch", "context", "bf16 pool ms", "fp8 pool ms", "GB/s bf16", "GB/s fp8",
               "bf16 share of bandwidth", "fp8 speedup"], rows)
    attention_tiles(run, fmt)

    # matmuls: bf16 dense, W4A16 (weights a quarter of bf16's bytes), fp8 (native where there is one)
    native = native_fp8_supported(run.device)
    shapes = [(1, 128, 192)] if run.dry_run else [
        (1, 576, 3072), (64, 576, 3072), (64, 1536, 576), (2048, 576, 3072), (1, 8192, 8192), (64, 8192, 8192),
        (4096, 8192, 8192)]
    rows = []
    for m, k, n in dict.fromkeys(shapes):
        if not run.has_time(3):
            break
        try:
            rows.append(time_matmul(run, m, k, n, native, fmt))
        except Exception as e:  # noqa: BLE001 - one shape's failure is a row, not the end of the table
            run.check(f"matmul timings {m} x {k} @ {k} x {n}", False, f"{type(e).__name__}: {e}")
    run.table("Matmuls: bf16 (torch); W4A16, group 64, through tinygemm and the Triton kernel; FP8 weights "
              "through the W8A16 Triton kernel and W8A8 `_scaled_mm` (activations rounded in the call)",
              ["shape", "bf16 ms", "W4A16 tinygemm ms", "W4A16 Triton ms", "fp8 W8A16 ms", "fp8 W8A8 ms",
               "bf16 TFLOP/s", "share of bf16 peak", "bf16 share of bandwidth", "W4A16 speedup (best)",
               "fp8 speedup (best)"], rows)
    run.check("every matmul shape ran", len(rows) == len(dict.fromkeys(shapes)),
              f"{len(rows)} of {len(dict.fromkeys(shapes))} shapes" + (" (each call made once, not timed, in the dry run)"
                                                                       if run.dry_run else ""))


def attention_tiles(run, fmt) -> None:
    """Decode attention over an 8B layer's heads at 64 x 2,048 with 16 to 128 keys a tile, both pools:
    the data behind DECODE_KEYS_PER_TILE."""
    from llmopt.kernels import paged_attention as pa

    rows, (batch, ctx) = [], ((2, 32) if run.dry_run else (64, 2048))
    pools = {name: paged_batch(run, [ctx] * batch, [1] * batch, num_kv_heads=8, group=4, head_dim=128,
                               block_size=16, dtype=run.bf16, cache_dtype=cache)
             for name, cache in (("bf16", run.bf16), ("fp8", torch.float8_e4m3fn))}
    for tile in (16, 32, 64, 128):
        if not run.has_time(2):
            break
        t = {name: run.timed(lambda b=b: pa.paged_attention_decode(
            b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["scale"],
            k_scale=b["k_scale"], v_scale=b["v_scale"], keys_per_tile=tile)) for name, b in pools.items()}
        rows.append([tile, fmt(t["bf16"]), fmt(t["fp8"]),
                     fmt(None if not (t["bf16"] and t["fp8"]) else t["bf16"] / t["fp8"], "{:.2f}x")])
    del pools
    run.table(f"Decode attention, 8B heads (8 x 128, group 4), {batch} x {ctx:,} tokens: keys a tile",
              ["keys a tile", "bf16 pool ms", "fp8 pool ms", "fp8 speedup"], rows)


def time_matmul(run, m, k, n, native, fmt) -> list:
    """One shape: bf16 (torch), W4A16 through tinygemm and through the Triton kernel (split-K as the
    engine chooses), FP8 weight-only (Triton W8A16) and W8A8 (`_scaled_mm`, the activations'
    rounding included); the speedups are the best of each width against bf16."""
    from llmopt.fp8.format import per_channel_scale, per_token_scale, quantize_fp8
    from llmopt.kernels.fp8_matmul import fp8_weight_matmul
    from llmopt.kernels.quant_matmul import w4a16_matmul
    from llmopt.layers.quant.cuda_int4 import CudaInt4Weight, tinygemm_fits
    from llmopt.layers.quant.gptq import to_gptq

    bw, peak = run.ceilings["bandwidth_GBps"], run.ceilings["bf16_TFLOPs"]
    x = torch.randn(m, k, device=run.device).to(run.bf16)
    w = (torch.randn(n, k, device=run.device) * 0.02).to(run.bf16)
    t_bf16 = run.timed(lambda: x @ w.t())
    q4 = random_int4(k, n, 64, False)
    t4 = {key: v.to(run.device) for key, v in to_gptq(q4).items()}
    t_w4 = run.timed(lambda: w4a16_matmul(x, t4["qweight"], t4["qzeros"], t4["scales"], None, 64, "gptq"))
    t_tiny = None
    if tinygemm_fits(n, k, 64, x.dtype, run.device) is None:
        tiny = CudaInt4Weight.from_affine(q4.qweight.to(run.device), q4.scales.to(run.device), q4.zeros.to(run.device))
        t_tiny = run.timed(lambda: tiny.matmul(x))
    ws = per_channel_scale(w)
    wq = quantize_fp8(w, ws)
    t_w8 = run.timed(lambda: fp8_weight_matmul(x, wq, ws))
    t_fp8 = None
    if native:
        def w8a8():
            s = per_token_scale(x)
            return torch._scaled_mm(quantize_fp8(x, s), wq.t(), scale_a=s.expand(m, 1).contiguous(),
                                    scale_b=ws.t().contiguous(), out_dtype=torch.bfloat16)
        t_fp8 = run.timed(w8a8)
    flops, wbytes = 2 * m * k * n, 2 * k * n
    tflops = None if t_bf16 is None else flops / t_bf16 / 1e9
    gbs = None if t_bf16 is None else (wbytes + 2 * m * (k + n)) / t_bf16 / 1e6
    best = lambda *ts: min((t for t in ts if t), default=None)  # noqa: E731
    b4, b8 = best(t_w4, t_tiny), best(t_w8, t_fp8)
    return [f"{m} x {k} @ {k} x {n}", fmt(t_bf16), fmt(t_tiny), fmt(t_w4), fmt(t_w8), fmt(t_fp8),
            fmt(tflops, "{:.1f}"), fmt(None if tflops is None else 100 * tflops / peak, "{:.1f}%"),
            fmt(None if gbs is None else 100 * gbs / bw, "{:.0f}%"),
            fmt(None if not (b4 and t_bf16) else t_bf16 / b4, "{:.2f}x"),
            fmt(None if not (b8 and t_bf16) else t_bf16 / b8, "{:.2f}x")]
