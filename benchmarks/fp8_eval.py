"""What FP8 costs and what it buys, on the bundled target: perplexity, greedy agreement,
KV capacity and weight bytes, for an FP8 KV cache (e4m3 with calibrated and with unit
scales, per KV head with keys and values Hadamard-rotated, e5m2), FP8 weights (weight-only,
as a CPU runs them, and W8A8, as FP8 tensor cores do), and both together, against full
precision, in one run.

    python benchmarks/fp8_eval.py                          # the committed table
    python benchmarks/fp8_eval.py --tokens 4096 --prompts 4 --out /tmp/fp8.md   # a quick one
    python benchmarks/fp8_eval.py --model smollm2 --prompts 16 \
        --out benchmarks/results/fp8_smollm2.md                     # the real model's table

Perplexity follows the course's one protocol (`llmopt.eval.PROTOCOL`) by default, through
each engine's own model and paged KV cache: attention reads keys and values back from the
FP8 pool, as a long prompt does in serving (`--chunk-size` feeds each window in chunks too). Greedy agreement
compares each configuration's greedy continuations with full precision's, token by
token. Rows that need something this install cannot do (FP8 weights without
`quantization="fp8"`) are reported as not run, with the reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from llmopt import LLM, SamplingParams
from llmopt.bench import header, table
from llmopt.bench.common import machine
from llmopt.eval import PROTOCOL, describe_protocol, follows_protocol, heldout_text, perplexity_of, window_nll

def rotated_per_head_kv(llm) -> None:
    """Keys and values turned by a Hadamard matrix, one e4m3 scale per KV head from the calibration split."""
    from llmopt.fp8.kv_scales import calibration_token_ids

    eng = llm.llm_engine
    eng.kv_cache.calibrate(eng.model, calibration_token_ids(eng.tokenizer), per_head=True, rotate=True)


def fp8_activations(llm) -> None:
    """W8A8: every FP8 linear rounds its activations to e4m3 per token, as FP8 tensor cores need."""
    from llmopt.fp8.linear import round_fp8_activations

    round_fp8_activations(llm.llm_engine.model)


CONFIGS = [  # (name, LLM keyword arguments[, what to do to the engine before measuring])
    ("full precision", {}),
    ("KV fp8 e4m3, calibrated scales", dict(kv_cache_dtype="fp8", calculate_kv_scales=True)),
    ("KV fp8 e4m3, unit scales", dict(kv_cache_dtype="fp8")),
    ("KV fp8 e4m3, per-head scales, rotated", dict(kv_cache_dtype="fp8"), rotated_per_head_kv),
    ("KV fp8 e5m2, calibrated scales", dict(kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True)),
    ("KV fp8 e5m2, unit scales", dict(kv_cache_dtype="fp8_e5m2")),
    ("weights fp8", dict(quantization="fp8")),
    ("weights fp8, W8A8", dict(quantization="fp8"), fp8_activations),
    ("weights fp8 + KV fp8 e4m3 (calibrated)", dict(quantization="fp8", kv_cache_dtype="fp8",
                                                     calculate_kv_scales=True)),
    # what a GPU runs by default (bf16 weights and KV), and FP8 KV against that: the 2x
    ("bf16 model and KV", dict(dtype="bfloat16")),
    ("bf16 model + KV fp8 e4m3, calibrated", dict(dtype="bfloat16", kv_cache_dtype="fp8",
                                                  calculate_kv_scales=True)),
]
KV_GOAL = 0.5     # percent of perplexity an e4m3 KV cache with calibrated scales may cost
BUDGET_GIB = 1.0  # the fixed KV budget the capacity column is counted in


def weight_bytes(model) -> int:
    """Bytes of every weight tensor (parameters and buffers: FP8 weights and their scales may
    be buffers), each storage once (tied embeddings), without RoPE's cos/sin tables."""
    seen, total = set(), 0
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    for name, t in tensors:
        if "rotary_emb" in name or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def greedy_prompts(llm, num_prompts: int, prompt_len: int) -> list[dict]:
    """Prompts cut from the held-out evaluation text at evenly spaced offsets."""
    ids = llm.tokenizer(heldout_text("eval"), add_special_tokens=False, verbose=False)["input_ids"]
    step = (len(ids) - prompt_len) // num_prompts
    return [{"prompt_token_ids": ids[i * step:i * step + prompt_len]} for i in range(num_prompts)]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    """Share of positions with the same token, continuations identical end to end, and the
    mean number of tokens before the first difference."""
    same = sum(a == b for r, t in zip(reference, tokens) for a, b in zip(r, t))
    total = sum(map(len, reference))
    first = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r))
             for r, t in zip(reference, tokens)]
    return {"same_tokens": same / total, "identical": sum(r == t for r, t in zip(reference, tokens)),
            "first_difference": sum(first) / len(first)}


def evaluate(name: str, kwargs: dict, args, prompts, prepare=None) -> dict:
    t0 = time.perf_counter()
    try:
        llm = LLM(model=args.model, **kwargs)
    except (ValueError, NotImplementedError, TypeError) as e:
        return {"name": name, "error": f"{type(e).__name__}: {e}"}
    if prepare is not None:
        prepare(llm)
    eng = llm.llm_engine
    per_window = window_nll(llm, max_tokens=args.tokens, seq_len=args.seq_len, chunk_size=args.chunk_size)
    ppl = perplexity_of(per_window)
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    cache = eng.kv_cache
    row = {
        "name": name, "ppl": ppl, "window_nll": per_window, "tokens": tokens,
        "kv_dtype": str(cache.cache_dtype).removeprefix("torch."),
        "scales": cache.scale_source if cache.is_fp8 else "-",
        "k_scale": _range(cache.k_scale), "v_scale": _range(cache.v_scale),
        "kv_bytes_per_token": eng.bytes_per_block // eng.block_size,
        "kv_tokens_in_budget": int(BUDGET_GIB * 2**30 // eng.bytes_per_block) * eng.block_size,
        "engine_blocks": eng.num_blocks,
        "weight_bytes": weight_bytes(llm.model), "weights": _weights_kind(llm),
        "seconds": time.perf_counter() - t0, "header": header(llm, "", load=args.load_before)}
    del llm, eng, cache
    gc.collect()
    return row


def _range(scales: list) -> tuple[float, float]:
    """Smallest and largest scale over layers (and KV heads, where a layer has one per head)."""
    values = [float(x) for s in scales for x in torch.as_tensor(s).reshape(-1)]
    return min(values), max(values)


def _weights_kind(llm) -> str:
    tensors = list(llm.model.named_parameters()) + list(llm.model.named_buffers())
    dtypes = {t.dtype for name, t in tensors if t.dim() == 2 and "rotary_emb" not in name}
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def render(rows: list[dict], args, command: str, seconds: float) -> str:
    base = rows[0]
    head = ["configuration", "KV cache", "KV scales (k; v, min-max over layers)", "weights", "perplexity",
            "vs full precision", "greedy: same tokens", "greedy: identical / first difference",
            "KV bytes/token", f"KV tokens in {BUDGET_GIB:g} GiB", "weight bytes"]
    body, notes = [], []
    for r in rows:
        if "error" in r:
            body.append([r["name"]] + ["not run"] * (len(head) - 1))
            notes.append(f"- **{r['name']}** was not run: {r['error']}")
            continue
        a = agreement(base["tokens"], r["tokens"])
        scales = "-" if r["scales"] == "-" else (
            f"{r['scales']}: {r['k_scale'][0]:.3g}-{r['k_scale'][1]:.3g}; {r['v_scale'][0]:.3g}-{r['v_scale'][1]:.3g}")
        body.append([
            r["name"], r["kv_dtype"], scales, r["weights"], f"{r['ppl']:.4f}",
            "baseline" if r is base else f"{100 * (r['ppl'] / base['ppl'] - 1):+.3f}%",
            f"{100 * a['same_tokens']:.1f}%", f"{a['identical']}/{len(r['tokens'])} / {a['first_difference']:.1f}",
            f"{r['kv_bytes_per_token']:,}", f"{r['kv_tokens_in_budget']:,} ({r['kv_tokens_in_budget'] / base['kv_tokens_in_budget']:.1f}x)",
            f"{r['weight_bytes']:,} ({r['weight_bytes'] / base['weight_bytes']:.2f}x)"])
    ran = {r["name"]: r for r in rows if "error" not in r}
    delta = lambda name: 100 * (ran[name]["ppl"] / base["ppl"] - 1)  # noqa: E731
    verdicts = []
    if "KV fp8 e4m3, calibrated scales" in ran:
        d = delta("KV fp8 e4m3, calibrated scales")
        verdicts.append(f"- Goal, e4m3 KV with calibrated scales within {KV_GOAL:g}% of full-precision perplexity: "
                        f"{d:+.3f}%, {'met' if abs(d) <= KV_GOAL else 'NOT met'}.")
    if "KV fp8 e4m3, per-head scales, rotated" in ran:
        d = delta("KV fp8 e4m3, per-head scales, rotated")
        verdicts.append(f"- The same goal with keys and values Hadamard-rotated and one scale per KV head: {d:+.3f}%, "
                        f"{'met' if abs(d) <= KV_GOAL else 'NOT met'}.")
    for n, what in (("weights fp8", "FP8 weights (weight-only, as this CPU runs them)"),
                    ("weights fp8, W8A8", "FP8 weights and activations (W8A8)")):
        if n in ran:
            verdicts.append(f"- Goal, {what} within 2% of full-precision perplexity: {delta(n):+.3f}%, "
                            f"{'met' if abs(delta(n)) <= 2 else 'NOT met'}.")
    others = [n for n in ("KV fp8 e4m3, unit scales", "KV fp8 e5m2, calibrated scales", "KV fp8 e5m2, unit scales")
              if n in ran]
    if others:
        verdicts.append("- What the other KV variants cost in perplexity: "
                        + "; ".join(f"{n.removeprefix('KV fp8 ')} {delta(n):+.3f}%" for n in others) + ".")
    if "bf16 model and KV" in ran:
        a = agreement(base["tokens"], ran["bf16 model and KV"]["tokens"])
        verdicts.append(f"- Greedy agreement is a harsh measure on this model, whose next-token choices are often "
                        f"near ties: bf16 weights and KV, the usual GPU setting, keep {100 * a['same_tokens']:.1f}% "
                        "of fp32's greedy tokens. Perplexity, averaged over every position, is the steadier measure.")
    return "\n".join([
        f"# FP8: KV cache and weights on `{args.model}`",
        "",
        f"{base['header'].removesuffix('; command: ``')}; command: `{command}` ({seconds / 60:.1f} min, "
        f"1-minute load average {os.getloadavg()[0]:.2f} at the end, which counts the run's own threads).",
        "",
        ("Perplexity: the course's " + describe_protocol() if follows_protocol(base["window_nll"]) else
         f"Perplexity: {args.tokens:,} tokens of the held-out evaluation split, windows of {args.seq_len} "
         "(not the course's protocol: not comparable with the other tables)")
        + (f", fed in chunks of {args.chunk_size}" if args.chunk_size else "")
        + "; attention reads keys and values back from the paged (FP8) cache. "
        f"Greedy: {args.prompts} prompts of "
        f"{args.prompt_len} held-out tokens, {args.gen_len} greedy tokens each, compared position by position "
        f"with full precision. KV tokens in a fixed budget: what the engine's pool holds in {BUDGET_GIB:g} GiB "
        "(its bytes per block, as it sizes the pool). Weight bytes: every weight tensor once.",
        "",
        table(head, body),
        "",
        *verdicts,
        *notes,
        "",
        "GPU: " + (f"this run used {torch.cuda.get_device_name()}." if torch.cuda.is_available() else
                   "this run had no CUDA device, so every FP8 number above comes from the exact CPU "
                   "emulation (fp8 storage, math in fp32); `benchmarks/gpu_check.py` checks and times the "
                   "native paths on a GPU and has not been run for this table."),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=PROTOCOL["max_tokens"], help="perplexity tokens")
    ap.add_argument("--seq-len", type=int, default=PROTOCOL["seq_len"])
    ap.add_argument("--chunk-size", type=int, default=None, help="feed each window in chunks (default: whole)")
    ap.add_argument("--prompts", type=int, default=32, help="greedy prompts")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=None, help="names of the rows to run (default: all)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fp8.md")
    args = ap.parse_args(argv)
    for name in ("tokens", "seq_len", "chunk_size", "prompts", "prompt_len", "gen_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    configs = CONFIGS if args.configs is None else [c for c in CONFIGS if c[0] in args.configs]
    if not configs or configs[0][0] != "full precision":
        configs = [CONFIGS[0]] + [c for c in configs if c[0] != "full precision"]
    command = shlex.join(["python", "benchmarks/fp8_eval.py", *argv])

    args.load_before = os.getloadavg()[0]  # before this run's own threads count in it
    t0 = time.perf_counter()
    probe = LLM(model=args.model, num_kv_blocks=8)
    prompts = greedy_prompts(probe, args.prompts, args.prompt_len)
    del probe
    rows = []
    for name, kwargs, *prepare in configs:
        print(f"{name} ...", flush=True)
        r = evaluate(name, kwargs, args, prompts, *prepare)
        rows.append(r)
        print("  " + (r["error"] if "error" in r else f"perplexity {r['ppl']:.4f} ({r['seconds']:.0f} s)"),
              flush=True)
    if "error" in rows[0]:
        raise SystemExit(f"the full-precision baseline failed: {rows[0]['error']}")
    text = render(rows, args, command, time.perf_counter() - t0)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    # the numbers too, for lessons that show this table without rerunning it
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "model": args.model, "machine": machine(), "rows": [
        {k: v for k, v in r.items() if k != "header"} for r in rows]}, indent=1) + "\n")
    return 0 if all(math.isfinite(r["ppl"]) for r in rows if "error" not in r) else 1


if __name__ == "__main__":
    raise SystemExit(main())
