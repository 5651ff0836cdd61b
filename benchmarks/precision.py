"""The precision table, measured on SmolLM2: every number format the course teaches, side by side.

Each row makes one version of the model (a dtype, quantize-on-load, a `quantize()` checkpoint,
an FP8 KV cache, a GGUF file) and measures, on the same evaluation tokens of the bundled held-out
text: perplexity against fp32 with a 90% paired-bootstrap interval over windows, the linear
layers' bits per weight and bytes as stored, decode tokens/s at batch 1 with bfloat16
activations (so the CPU int4 / int8 kernels run where a format has one), and how long
quantizing took.

    python benchmarks/precision.py --rows fp32 bf16 --max-tokens 12288
    python benchmarks/precision.py --rows gptq4-rot --max-tokens 12288 --append   # one row per process

Rows run one per process and gather in benchmarks/results/precision_smollm2.json (--append);
`--render` rewrites the table (precision_smollm2.md) from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmopt import LLM, SamplingParams
from llmopt.bench.common import machine
from llmopt.eval import PROTOCOL, perplexity_of, window_nll
from llmopt.quant import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from precision_table import render  # noqa: E402
from quant import linear_bytes_of  # noqa: E402

MODEL = "smollm2"
INT4 = dict(bits=4, group_size=64)
# name -> (label, how it is made). engine: LLM arguments on the full-precision model; quantize:
# quantize() arguments; gguf: llama.cpp's type written by llmopt.quant.gguf_write.
ROWS = {
    "fp32": ("fp32 (reference)", dict(engine=dict())),
    "bf16": ("bf16 weights and activations", dict(engine=dict(dtype="bfloat16"))),
    "int8": ("int8 weights, per channel (RTN)", dict(engine=dict(quantization="int8"))),
    "fp8-w": ("FP8 e4m3 weights, per channel (weight-only, as run without FP8 units)",
              dict(engine=dict(quantization="fp8"))),
    "fp8-w8a8": ("FP8 e4m3 weights and activations (W8A8, per-token activation scales, as FP8 tensor cores run it)",
                 dict(engine=dict(quantization="fp8"), fp8_activations=True)),
    "fp8-kv": ("FP8 e4m3 KV, per-tensor scales (calibrated amax)",
               dict(engine=dict(kv_cache_dtype="fp8", calculate_kv_scales=True))),
    "fp8-kv-head": ("FP8 e4m3 KV, per-head scales (calibrated amax)",
                    dict(engine=dict(kv_cache_dtype="fp8"), per_head_kv=True)),
    "fp8-kv-smooth": ("FP8 e4m3 KV, per-head scales, keys smoothed (mean key subtracted)",
                      dict(engine=dict(kv_cache_dtype="fp8"), per_head_kv=True, smooth_keys=True)),
    "fp8-kv-channel": ("FP8 e4m3 KV, per-channel scales (calibrated amax per head and channel)",
                       dict(engine=dict(kv_cache_dtype="fp8"), per_head_kv=True, per_channel=True)),
    "fp8-kv-unit": ("FP8 e4m3 KV, unit scales", dict(engine=dict(kv_cache_dtype="fp8"))),
    "fp8-kv-rot": ("FP8 e4m3 KV, per-head scales, keys and values Hadamard-rotated (calibrated amax)",
                   dict(engine=dict(kv_cache_dtype="fp8"), per_head_kv=True, rotate_kv=True)),
    "rtn4": ("int4 RTN g64", dict(quantize=dict(method="rtn", sym=False, **INT4))),
    "gptq4": ("int4 GPTQ g64", dict(quantize=dict(method="gptq", sym=False, desc_act=True, **INT4))),
    "awq4": ("int4 AWQ g64", dict(quantize=dict(method="awq", **INT4))),
    "rtn4-rot": ("int4 RTN g64, Hadamard-rotated",
                 dict(quantize=dict(method="rtn", sym=False, rotation="hadamard", **INT4))),
    "gptq4-rot": ("int4 GPTQ g64, Hadamard-rotated",
                  dict(quantize=dict(method="gptq", sym=False, desc_act=True, rotation="hadamard", **INT4))),
    "gptq4-rot-mse": ("int4 GPTQ g64, Hadamard-rotated, grid range searched (mse=2.4)",
                      dict(quantize=dict(method="gptq", sym=False, desc_act=True, rotation="hadamard", mse=2.4,
                                         **INT4))),
    "awq4-rot": ("int4 AWQ g64, Hadamard-rotated", dict(quantize=dict(method="awq", rotation="hadamard", **INT4))),
    "nf4": ("NF4 block 64, double quant (bitsandbytes layout)",
            dict(quantize=dict(method="nf4", group_size=64, double_quant=True))),
    # why FP8 KV costs what it costs: the same rounding applied outside the engine, to K or V alone
    "kv-k-only": ("diagnosis: e4m3 keys only (per-head scales, emulated)", dict(emulate="k")),
    "kv-v-only": ("diagnosis: e4m3 values only (per-head scales, emulated)", dict(emulate="v")),
    "q8_0": ("GGUF Q8_0", dict(gguf="Q8_0")),
    "q4_k_m": ("GGUF Q4_K_M", dict(gguf="Q4_K_M")),
    "q4_0": ("GGUF Q4_0", dict(gguf="Q4_0")),
}
# The seed's precision table (the course's prose before this measurement)
DECODE_TOKENS = 32
GGUF_LINEARS = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.")


def folder_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def gguf_linear_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the decoder's linear tensors in a GGUF file, the same in fp16)."""
    from gguf import GGUFReader

    stored = fp16 = 0
    for t in GGUFReader(str(path)).tensors:
        if t.name.startswith("blk.") and any(k in t.name for k in GGUF_LINEARS):
            stored += int(t.n_bytes)
            fp16 += 2 * int(t.n_elements)
    return stored, fp16


def prepare(llm, spec: dict) -> None:
    """What a row does to a loaded engine beyond LLM(...)'s arguments: per-head FP8 KV scales
    (keys smoothed, per channel, or keys and values rotated first), or FP8 activations (W8A8)."""
    from llmopt.fp8.linear import round_fp8_activations
    from llmopt.fp8.kv_scales import calibration_token_ids

    engine = llm.llm_engine
    if spec.get("per_head_kv"):
        engine.kv_cache.calibrate(engine.model, calibration_token_ids(engine.tokenizer), per_head=True,
                                  smooth_keys=spec.get("smooth_keys", False),
                                  per_channel=spec.get("per_channel", False), rotate=spec.get("rotate_kv", False))
    if spec.get("fp8_activations"):
        round_fp8_activations(engine.model)


class EmulatedFP8KV:
    """Attention over whole windows (no cache) with keys and/or values rounded through
    fp8(x / s) * s first, s one scale per KV head: the engine's FP8 cache, one part at a time."""

    def __init__(self, parts: str, k_scale: list, v_scale: list):
        from llmopt.worker.kv_cache import NoKVCache

        self.cache, self.parts, self.k_scale, self.v_scale = NoKVCache(), parts, k_scale, v_scale
        self.layout, self.rotation, self.attend = "none", None, NoKVCache.attend

    def begin_step(self, meta) -> None:
        self.cache.begin_step(meta)

    def store(self, layer, k, v, meta):  # attention reads what this returns: k and v as the pool holds them
        from llmopt.fp8.format import dequantize_fp8, quantize_fp8

        ks, vs = self.k_scale[layer][:, None], self.v_scale[layer][:, None]
        if "k" in self.parts:
            k = dequantize_fp8(quantize_fp8(k, ks), ks, k.dtype)
        if "v" in self.parts:
            v = dequantize_fp8(quantize_fp8(v, vs), vs, v.dtype)
        return k, v


@torch.inference_mode()
def emulated_window_nll(llm, parts: str, max_tokens: int) -> list[tuple[float, int]]:
    """window_nll's windows (512 tokens, overlapping by one), scored with EmulatedFP8KV."""
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.model.forward import run_model
    from llmopt.worker.kv_cache import observe_kv_amax
    from llmopt.fp8.kv_scales import calibration_token_ids
    from llmopt.eval import heldout_text
    from llmopt.fp8.format import scale_from_amax

    engine = llm.llm_engine
    model = engine.model
    k_amax, v_amax = observe_kv_amax(model, calibration_token_ids(engine.tokenizer), len(model.model.layers), True)
    cache = EmulatedFP8KV(parts, [scale_from_amax(a) for a in k_amax], [scale_from_amax(a) for a in v_amax])
    ids = engine.tokenizer(heldout_text("eval"), add_special_tokens=False, verbose=False)["input_ids"][:max_tokens]
    out = []
    for s in range(0, len(ids) - 1, 512):
        w = ids[s:s + 513]
        hidden = run_model(model, cache, torch.tensor(w[:-1]), AttentionMetadata.uncached([len(w) - 1]))
        nll = torch.nn.functional.cross_entropy(model.compute_logits(hidden), torch.tensor(w[1:]), reduction="sum")
        out.append((nll.item(), len(w) - 1))
    return out


@torch.no_grad()
def massive_channel(model, name: str) -> dict:
    """The residual stream's largest channel at each block's input (calibration text, after the
    RMS normalization and before its weight g): its share of the vector's energy, and g there
    against the median g. A rotation spreads that channel over all of them."""
    from llmopt import model_path
    from llmopt.model.loader import load_tokenizer
    from llmopt.quant.calibration import BlockInputs, calibration_windows

    windows = calibration_windows(load_tokenizer(model_path(name)), None, 2, 512, model.config.vocab_size)
    runner = BlockInputs(model, windows)
    share, g_ratio = 0.0, 0.0
    for layer in model.model.layers:
        x = runner.hidden.float()
        e = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).pow(2).mean(0)   # energy per channel
        c = int(e.argmax())
        if e[c] / e.sum() > share:
            g = layer.input_layernorm.weight.float().abs()
            share, g_ratio = float(e[c] / e.sum()), float(g[c] / g.median())
        runner.hidden = runner.run(layer)
    return {"top_channel_energy": share, "g_there_vs_median": g_ratio}


@torch.no_grad()
def weight_diagnosis() -> dict:
    """Relative RTN error ||W - Q(W)|| / ||W|| of the decoder's linears, averaged, at 4 bits: as
    loaded (groups of 32 and 64) and after the rotation (64): whether the weights still sit on
    the 4-bit grid of the file they came from, and what a rotation does to that."""
    from llmopt import model_path
    from llmopt.model.loader import load_model
    from llmopt.quant.rotation import rotate_model
    from llmopt.quant.rtn import fake_quantize

    def mean_error(model, group):
        errs = [float((w - fake_quantize(w, 4, group, sym=False)).norm() / w.norm())
                for w in (model.get_submodule(n).weight.data for n in model.quantizable_linears())]
        return sum(errs) / len(errs)

    out = {}
    for name in (MODEL, "tiny"):   # tiny: bf16 weights on no grid, for contrast
        model = load_model(model_path(name))
        out[name] = {"g32": mean_error(model, 32), "g64": mean_error(model, 64), **massive_channel(model, name)}
        rotate_model(model)
        out[name]["g64 rotated"] = mean_error(model, 64)
    return out


@torch.no_grad()
def qk_overlap(num_tokens: int = 512) -> dict:
    """Per layer, D sum_i q_i^2 k_i^2 / (|q|^2 |k|^2) averaged over query-key pairs (every 8th token
    of a calibration window): 1 when the energy of q and k is spread evenly over the D channels (or
    lands on different ones), larger when both are large in the same few. e4m3 rounds k_i with an
    error the size of k_i, so that is how much of q.k's error a few channels carry; and after a
    Hadamard rotation of both, as the rotated FP8 KV cache stores them."""
    import llmopt.model.llama as llama
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.layers.hadamard import random_hadamard
    from llmopt.model.forward import run_model
    from llmopt.worker.kv_cache import NoKVCache
    from llmopt.fp8.kv_scales import calibration_token_ids

    engine = LLM(MODEL).llm_engine
    seen, attend = {}, llama.attention

    def spy(q, k, v, cache, layer, scale, window=None):
        seen[layer] = (q.float()[::8], k.float()[::8].repeat_interleave(q.shape[1] // k.shape[1], 1))
        return attend(q, k, v, cache, layer, scale, window)

    def ratio(q, k):
        q2, k2 = q.pow(2), k.pow(2)
        num = torch.einsum("thd,shd->h", q2, k2)
        return float((num / (torch.einsum("th,sh->h", q2.sum(-1), k2.sum(-1)) / q.shape[-1])).mean())

    ids = calibration_token_ids(engine.tokenizer, num_tokens=num_tokens)[0]
    llama.attention = spy
    try:
        run_model(engine.model, NoKVCache(), torch.tensor(ids), AttentionMetadata.uncached([len(ids)]))
    finally:
        llama.attention = attend
    r = random_hadamard(engine.model_config.head_dim, 0).float()
    return {"plain": [ratio(q, k) for _, (q, k) in sorted(seen.items())],
            "rotated": [ratio(q @ r, k @ r) for _, (q, k) in sorted(seen.items())]}


def run_row(name: str, workdir: Path, max_tokens: int, num_samples: int) -> dict:
    label, spec = ROWS[name]
    if "emulate" in spec:
        llm = LLM(MODEL)
        row = {"name": name, "label": label, "load_avg_start": os.getloadavg()[0], "quant_seconds": None,
               "file_bytes": None, "decode_tok_s": None}
        row["linear_bytes"], row["fp16_linear_bytes"] = linear_bytes_of(llm)
        row["linear_bytes"] = row["fp16_linear_bytes"] * 2
        row["window_nll"] = emulated_window_nll(llm, spec["emulate"], max_tokens)
        row["perplexity"] = perplexity_of(row["window_nll"])
        row["load_avg_end"] = os.getloadavg()[0]
        return row
    row = {"name": name, "label": label, "load_avg_start": os.getloadavg()[0], "quant_seconds": None,
           "file_bytes": None}
    engine_kw: dict = {}
    if "engine" in spec:
        source, engine_kw = MODEL, dict(spec["engine"])
        llm = LLM(source, **engine_kw)
        prepare(llm, spec)
        row["linear_bytes"], row["fp16_linear_bytes"] = linear_bytes_of(llm)
        if engine_kw.get("dtype") is None and not engine_kw.get("quantization"):
            row["linear_bytes"] = row["fp16_linear_bytes"] * 2            # fp32
    elif "quantize" in spec:
        q = dict(spec["quantize"])
        if q["method"] in ("gptq", "awq"):
            q["num_samples"] = num_samples
        result = quantize(MODEL, out=workdir / name, progress=False, **q)
        source = str(result.path)
        row.update(quant_seconds=result.seconds, linear_bytes=result.linear_bytes,
                   fp16_linear_bytes=result.fp16_linear_bytes, file_bytes=folder_bytes(result.path))
        llm = LLM(source)
    else:
        from llmopt.quant.gguf_write import write_gguf

        result = write_gguf(MODEL, spec["gguf"], workdir / f"{name}.gguf")
        source = str(result.path)
        row.update(quant_seconds=result.seconds, file_bytes=result.file_bytes)
        row["linear_bytes"], row["fp16_linear_bytes"] = gguf_linear_bytes(result.path)
        llm = LLM(source)
        if spec["gguf"] in ("Q8_0", "Q4_0"):   # decode on the int8 / int4 kernels from the file's blocks
            engine_kw = dict(quantization="gguf")
    if llm.llm_engine.kv_cache.is_fp8:
        row["kv_scales"] = llm.llm_engine.kv_cache.scale_source
    t0 = time.perf_counter()
    row["window_nll"] = window_nll(llm, max_tokens=max_tokens)
    row["eval_seconds"] = time.perf_counter() - t0
    row["perplexity"] = perplexity_of(row["window_nll"])
    del llm
    row["decode_source"], row["decode_engine"] = source, engine_kw
    # bfloat16 activations unless the row sets its own dtype (the bf16 row does)
    llm = LLM(source, **{"dtype": "bfloat16", "enforce_eager": True, **engine_kw})
    prepare(llm, spec)
    row["decode_tok_s"] = _decode(llm)
    row["load_avg_end"] = os.getloadavg()[0]
    return row


def _decode(llm, repeats: int = 2) -> float:
    """Batch-1 greedy decode: DECODE_TOKENS / (t(1 + DECODE_TOKENS tokens) - t(1 token)), the
    fastest of `repeats` after one warm-up (the CPU is shared: the best run is the least disturbed)."""
    best = {1: float("inf"), 1 + DECODE_TOKENS: float("inf")}
    for i in range(repeats + 1):
        for n in best:
            t0 = time.perf_counter()
            llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            if i:
                best[n] = min(best[n], time.perf_counter() - t0)
    return DECODE_TOKENS / (best[1 + DECODE_TOKENS] - best[1])


def decode_again(saved: dict, keep: Path) -> None:
    """Measure every row's decode speed again in this one process, one row after another
    (RTN and NF4 checkpoints that are gone are made again: they take seconds)."""
    for row in saved["rows"]:
        spec = ROWS[row["name"]][1]
        if "emulate" in spec:
            continue
        source, kw = row.get("decode_source"), row.get("decode_engine", {})
        if source is None and "engine" in spec:
            source, kw = MODEL, dict(spec["engine"])
        if source is None or not Path(source).exists() and source != MODEL:
            if spec.get("quantize", {}).get("method") not in ("rtn", "nf4"):
                continue
            source = str(quantize(MODEL, out=keep / row["name"], progress=False, **spec["quantize"]).path)
        llm = LLM(source, dtype="bfloat16", enforce_eager=True, **kw)
        prepare(llm, spec)
        row["decode_tok_s"] = _decode(llm)
        print(f"{row['name']}: decode {row['decode_tok_s']:.1f} tok/s", flush=True)
        del llm
    saved["decode_again"] = True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=[])
    ap.add_argument("--max-tokens", type=int, default=PROTOCOL["max_tokens"])
    ap.add_argument("--num-samples", type=int, default=16, help="GPTQ / AWQ calibration windows of 512 tokens")
    ap.add_argument("--append", action="store_true", help="add to the earlier JSON (same evaluation tokens)")
    ap.add_argument("--render", action="store_true", help="measure nothing: rewrite the table from the JSON")
    ap.add_argument("--diagnose-weights", action="store_true", help="add the RTN weight-error diagnosis")
    ap.add_argument("--diagnose-kv", action="store_true", help="add the query-key channel overlap, plain and rotated")
    ap.add_argument("--decode-again", action="store_true",
                    help="re-measure every row's decode speed in one process (needs the kept checkpoints)")
    ap.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()) / "llmopt-precision",
                    help="where the checkpoints are written and kept (for --decode-again)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    json_path, md_path = args.out_dir / "precision_smollm2.json", args.out_dir / "precision_smollm2.md"
    saved = json.loads(json_path.read_text()) if (args.append or args.render) and json_path.is_file() else None
    if saved is None:
        saved = {"command": "", "cpu": f"{machine()} ({os.cpu_count()} cores)", "threads": torch.get_num_threads(),
                 "num_samples": args.num_samples, "rows": []}
    if args.decode_again:
        decode_again(saved, args.keep)
        json_path.write_text(json.dumps(saved, indent=1) + "\n")
    if args.diagnose_weights:
        saved["weight_diagnosis"] = weight_diagnosis()
        json_path.write_text(json.dumps(saved, indent=1) + "\n")
    if args.diagnose_kv:
        saved["qk_overlap"] = qk_overlap()
        json_path.write_text(json.dumps(saved, indent=1) + "\n")
    if args.rows:
        command = shlex.join(["python", "benchmarks/precision.py", *argv])
        saved["command"] = f"{saved['command']}; {command}" if saved["command"] else command
        args.keep.mkdir(parents=True, exist_ok=True)
        for name in args.rows:
            row = run_row(name, args.keep, args.max_tokens, args.num_samples)
            print(f"{name}: perplexity {row['perplexity']:.3f}, decode {row['decode_tok_s']} tok/s, "
                  f"quantized in {row['quant_seconds']} s, load {row['load_avg_start']:.2f}", flush=True)
            saved["rows"] = [r for r in saved["rows"] if r["name"] != name] + [row]
            json_path.write_text(json.dumps(saved, indent=1) + "\n")
    if saved["rows"]:
        saved["rows"].sort(key=lambda r: list(ROWS).index(r["name"]))
        saved["not_measured"] = [ROWS[n][0] for n in ROWS if n not in {r["name"] for r in saved["rows"]}]
        text = render(saved)
        md_path.write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
