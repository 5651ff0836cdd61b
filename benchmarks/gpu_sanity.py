"""The sections of gpu_check.py that hold SmolLM2 on the GPU to the CPU's references.

- `smollm2-sanity`: the model file is the CPU's (sha256); in float32 the GPU's greedy tokens are
  the CPU's, 16 / 16, each log-probability within LOGPROB_TOL nats of the CPU's, and its
  perplexity within PPL_TOL of the CPU's; then bf16 and fp16: every greedy token within MAX_GAP
  nats of the best token at its position (teacher-forced through the float32 engine that just
  reproduced the CPU), perplexity within PPL_TOL of the CPU's float32.
- `smollm2-quality`: FP8 KV, FP8 weights and W4A16 (RTN, GPTQ, AWQ) in bf16, each with its
  perplexity within PPL_TOL of the same configuration on the CPU (same activation dtype), greedy
  agreement with bf16 and KV blocks in the same memory: the GPU quality table lessons 06 and 07
  read.

Every later section that runs SmolLM2 first checks that `smollm2-sanity` passed (`require_sane`):
a section whose model fails its sanity check fails, and the report with it. The references come
from benchmarks/gpu_references.py (committed for SmolLM2; in the dry run computed for the bundled
model at the start, and `--plant-fault` then corrupts one weight matrix of the model the sections
load, which these checks must catch).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from llmopt.eval import describe_protocol, forced_gaps

from gpu_engine import MAX_GAP, agreement, free, make_llm
from gpu_references import CONFIGS, compute, configure, file_sha256, greedy, model_file, perplexity

# float32 on two machines differs by summation order alone: thousandths of a nat at most, where a
# wrong kernel or wrong bytes move log-probabilities by tenths or more
LOGPROB_TOL = 0.01
# relative: bf16 moves SmolLM2's perplexity by 0.09% on the CPU (results/precision_smollm2.md),
# FP8 and 4-bit weights by 1-30%, broken weights by orders of magnitude
PPL_TOL = 0.01
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion in one sentence."]
ACTIVATIONS = {"bf16": ("bf16 weights and activations", torch.bfloat16),
               "fp16": ("fp16 weights and activations (the T4 class)", torch.float16)}


def dry_run_model(work: Path, plant_fault: bool) -> tuple[str, dict]:
    """The dry run's SmolLM2: the bundled model, its references computed here first; with
    plant_fault, a copy of it with one weight matrix drowned in noise of its own size, the kind of
    fault (a wrong layout, a broken kernel, bad bytes) the sanity checks exist to catch."""
    import shutil
    import time

    from safetensors.torch import load_file, save_file

    from llmopt import model_path

    tiny = model_path("tiny")
    t0 = time.process_time()
    # A planted fault fails smollm2-sanity, and every section that would read the twins' references
    # stops at `require_sane` before it does: they are not computed for it.
    refs = compute(str(tiny), torch.bfloat16, dry_run=True, log=lambda line: print(f"  references: {line}"),
                   with_twins=not plant_fault)
    print(f"references for the bundled model computed in {time.process_time() - t0:.1f} s of CPU", flush=True)
    if not plant_fault:
        return str(tiny), refs
    planted = work / "tiny-planted-fault"
    shutil.copytree(tiny, planted)
    weights = load_file(str(planted / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    w = weights[name]
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.float().pow(2).mean().sqrt()
    weights[name] = (w.float() + noise).to(w.dtype)
    save_file(weights, str(planted / "model.safetensors"), metadata={"format": "pt"})
    print(f"planted fault: {name} corrupted in {planted.name}", flush=True)
    return str(planted), refs


def require_sane(run) -> bool:
    """A check that the model passed `smollm2-sanity`: the sections after it measure nothing otherwise."""
    sane = run.shared.get("sane")
    return run.check("the model passed smollm2-sanity (its checks against the CPU's references)", sane is True,
                     "" if sane else "smollm2-sanity " + ("did not run" if sane is None else "failed"))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def within(value: float, reference: float, tol: float = PPL_TOL) -> tuple[bool, str]:
    rel = value / reference - 1
    return math.isfinite(value) and abs(rel) <= tol, f"{value:.4f} vs the CPU's {reference:.4f} ({100 * rel:+.3f}%)"


def section_smollm2_sanity(run) -> None:
    refs, plan = run.refs, run.refs["plan"]
    run.shared["sane"] = False
    path = model_file(run.model)
    run.check("the model file is the CPU's (sha256)", file_sha256(path) == refs["sha256"],
              f"{path.name}: {file_sha256(path)[:16]}..., the references' {refs['sha256'][:16]}...")
    prompts, cpu_tokens, cpu_logprobs = (refs["greedy"][k] for k in ("prompts", "tokens", "logprobs"))
    fp32 = make_llm(run, run.model, dtype=torch.float32)
    tokens, logprobs = greedy(fp32, prompts, plan["new_tokens"])
    same = sum(a == b for a, b in zip(tokens, cpu_tokens))
    firsts = [first_difference(a, b) for a, b in zip(tokens, cpu_tokens) if a != b]
    run.check(f"float32 greedy tokens = the CPU's, {len(prompts)} / {len(prompts)}", same == len(prompts),
              f"{same}/{len(prompts)} identical" + (f"; first differences at tokens {firsts[:8]}" if firsts else ""))
    # log-probabilities compared where both chose the same tokens so far (after a difference the contexts differ)
    diffs = [abs(x - y) for a, b, la, lb in zip(tokens, cpu_tokens, logprobs, cpu_logprobs)
             for x, y in list(zip(la, lb))[:first_difference(a, b) + 1]]
    worst = max(diffs, default=math.inf)
    run.check(f"float32 log-probabilities within {LOGPROB_TOL} nats of the CPU's", worst <= LOGPROB_TOL,
              f"largest difference {worst:.2e} nats over {len(diffs)} tokens")
    ppl32 = perplexity(fp32, plan)
    ok, detail = within(ppl32, refs["perplexity"]["float32"])
    run.check(f"float32 perplexity within {PPL_TOL:.0%} of the CPU's", ok, detail)
    rows = {}
    for name, (label, dtype) in ACTIVATIONS.items():
        if not run.has_time(10):
            break
        llm = make_llm(run, run.model, dtype=dtype)
        mine, _ = greedy(llm, prompts, plan["new_tokens"])
        gaps = forced_gaps(fp32, prompts, mine)
        gap = float(gaps.max()) if len(gaps) else math.inf
        run.check(f"{name}: every greedy token within {MAX_GAP} nats of the float32 best (teacher-forced)",
                  gap <= MAX_GAP, f"largest gap {gap:.3f}; {int((gaps > 0).sum())}/{len(gaps)} tokens not the "
                  f"float32 argmax; {sum(a == b for a, b in zip(mine, cpu_tokens))}/{len(prompts)} sequences = the CPU's")
        ppl = perplexity(llm, plan)
        ok, detail = within(ppl, refs["perplexity"]["float32"])
        run.check(f"{name} perplexity within {PPL_TOL:.0%} of the CPU's float32", ok, detail)
        if name == "bf16":  # for a reader: a model that fails these checks answers in strings of unrelated tokens
            from llmopt import SamplingParams

            chat = llm.chat([[{"role": "user", "content": q}] for q in CHAT],
                            SamplingParams(temperature=0.0, max_tokens=8 if run.dry_run else 32), use_tqdm=False)
            run.table("Chat answers in bf16 (greedy)", ["question", "answer"],
                      [[q, o.outputs[0].text.replace("\n", " ").replace("|", "/")] for q, o in zip(CHAT, chat)])
        rows[name] = {"name": name, "label": label, "activations": str(dtype).removeprefix("torch."),
                      "perplexity": ppl, "cpu_perplexity": None, "vs_cpu": None, "largest_gap": gap,
                      "kv_blocks": llm.llm_engine.num_blocks, "tokens": mine}
        del llm
        free()
    run.section.numbers.update(float32={"identical": same, "largest_logprob_difference": worst, "perplexity": ppl32},
                               **{n: {k: v for k, v in r.items() if k != "tokens"} for n, r in rows.items()})
    del fp32
    free()
    run.shared["rows"] = rows
    run.shared["sane"] = all(c["ok"] for c in run.section.checks) and len(rows) == len(ACTIVATIONS)
    run.table("Checks against the CPU's references (benchmarks/gpu_references/)", ["check", "", "what was seen"],
              [[c["name"], "ok" if c["ok"] else "FAILED", c["detail"].replace("|", "/")] for c in run.section.checks])


def quality_row(run, name, llm, base, cpu_ppl, label) -> dict:
    """One row of the quality table: perplexity, against bf16 and the CPU, greedy agreement, KV blocks."""
    refs, plan = run.refs, run.refs["plan"]
    tokens, _ = greedy(llm, refs["greedy"]["prompts"], plan["new_tokens"])
    ppl = perplexity(llm, plan)
    same, share = agreement(tokens, base["tokens"])
    blocks = llm.llm_engine.num_blocks
    return {"name": name, "label": label, "activations": run.refs["twins"]["activations"], "perplexity": ppl,
            "cpu_perplexity": cpu_ppl, "vs_cpu": None if cpu_ppl is None else ppl / cpu_ppl - 1,
            "greedy_vs_bf16": {"identical": same, "of": len(tokens), "prefix_share": share},
            "kv_blocks": blocks, "kv_blocks_vs_bf16": blocks / base["kv_blocks"]}


def section_smollm2_quality(run) -> None:
    from llmopt.quant import quantize

    if not require_sane(run):
        return
    refs, plan, rows = run.refs, run.refs["plan"], run.shared["rows"]
    base_name = "bf16" if refs["twins"]["activations"] == "bfloat16" else "fp16"
    base = rows[base_name]
    fp32 = refs["perplexity"]["float32"]
    table = []
    for r in rows.values():
        same, share = agreement(r["tokens"], base["tokens"])
        table.append({**{k: v for k, v in r.items() if k not in ("tokens", "largest_gap")},
                      "greedy_vs_bf16": {"identical": same, "of": len(r["tokens"]), "prefix_share": share},
                      "kv_blocks_vs_bf16": r["kv_blocks"] / base["kv_blocks"]})
    dtype = getattr(torch, refs["twins"]["activations"])
    for name in plan["twins"]:
        if not run.has_time(8):
            break
        label, kw, spec = CONFIGS[name]
        source = run.model
        if spec is not None:
            source = run.work / name
            seconds, _ = run.wall(lambda: quantize(str(run.model), out=str(source), device=run.device,
                                                   progress=False, **spec, **plan["quantize"]))
            run.note(f"{name}: quantized on the {run.device.upper()} in {seconds:.1f} s")
        llm = make_llm(run, source, dtype=dtype, **plan.get("engine", {}), **kw)
        configure(llm, name)
        if spec is not None and run.device == "cuda":  # the W4A16 Triton kernel runs only on CUDA
            from llmopt.layers.quant.gptq import GPTQLinear

            quant = [m for m in llm.model.modules() if isinstance(m, GPTQLinear)]
            run.check(f"{name}: the model's linears run the W4A16 kernel", len(quant) > 0, f"{len(quant)} layers")
        row = quality_row(run, name, llm, base, refs["twins"]["perplexity"][name], label)
        ok, detail = within(row["perplexity"], row["cpu_perplexity"])
        run.check(f"{name} perplexity within {PPL_TOL:.0%} of the same configuration on the CPU "
                  f"({row['activations']} activations)", ok, detail)
        table.append(row)
        del llm
        free()
    measured = [r["name"] for r in table if r["cpu_perplexity"] is not None]
    run.check("every configuration of the references measured", measured == plan["twins"],
              f"{len(measured)} of {len(plan['twins'])}: {', '.join(measured) or 'none'}")
    for row in table:
        row["vs_cpu_fp32"], row["vs_bf16"] = row["perplexity"] / fp32 - 1, row["perplexity"] / base["perplexity"] - 1
    run.section.numbers.update(rows=table, cpu_fp32_perplexity=fp32,
                               protocol=describe_protocol())
    pct = lambda v: "-" if v is None else f"{100 * v:+.2f}%"  # noqa: E731
    model = "The bundled model (for SmolLM2)" if run.dry_run else "SmolLM2"
    run.table(f"{model} quality on {run.device_name}: each row against {base_name} and against the CPU "
              f"(float32 perplexity {fp32:.4f})",
              ["configuration", "activations", "perplexity", "vs the CPU's same configuration", "vs CPU float32",
               f"vs {base_name}", f"greedy = {base_name} (identical, prefix)", "KV blocks in the same memory"],
              [[r["label"], r["activations"], f"{r['perplexity']:.4f}",
                pct(r["vs_cpu"]) + ("" if r["cpu_perplexity"] is None else f" (CPU {r['cpu_perplexity']:.4f})"),
                pct(r["vs_cpu_fp32"]), pct(r["vs_bf16"]),
                f"{r['greedy_vs_bf16']['identical']}/{r['greedy_vs_bf16']['of']}, "
                f"{100 * r['greedy_vs_bf16']['prefix_share']:.0f}%",
                f"{r['kv_blocks']:,} ({r['kv_blocks_vs_bf16']:.2f}x)"] for r in table])
