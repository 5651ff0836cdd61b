"""The speed sections of gpu_check.py: decode at batch 1 against the roofline, and speculation.

- `decode-speed`: SmolLM2 in bf16 at batch 1, end to end (`LLM.generate` wall time for 256 tokens
  after a 32-token prompt, warm, best of 3), its step three ways side by side (STEP_VARIANTS: the
  forward's graph alone, the whole step one graph with fused kernels, and that with the host
  overlapped); then a Llama-3.1-8B shape with random weights
  (`load_format="dummy"`: real shapes, for speed only) in bf16: decode at batch 1 as bytes of
  weights and KV read per second against the bandwidth measured in `env`, and the prefill of 8
  prompts of 2,048 tokens as FLOP/s against the measured bf16 peak.
- `speculation`: at batch 1, n-gram lookup on the edit workload (llmopt.bench.edit: rename a
  variable in ~300 tokens of code, answers that repeat the prompt) and the bundled EAGLE head on
  chat questions, each against plain decoding on the same requests: the speedup in wall time,
  and every speculative token within MAX_GAP nats of the plain engine's best (teacher-forced;
  bf16 verification of k + 1 tokens may round a near-tie the other way, a wrong one picks
  tokens nats below).

- `quant-speed`: decode with W4A16 (RTN weights, tinygemm on CUDA) and FP8 weights against bf16,
  each engine alone: the Llama-3.1-8B shape at batch 1, SmolLM2 at 1 and 64 sequences.

Their figures feed the report's `summary` block (gpu_check.py). Each runs only on a model that
passed `smollm2-sanity`. In the dry run the bundled models stand in (tiny for SmolLM2 and, with
random weights, for the 8B shape), with short requests; its timings are the CPU's and mean nothing.
"""

from __future__ import annotations

import time

from llmopt import SamplingParams
from llmopt.eval import forced_gaps

from gpu_engine import MAX_GAP, agreement, decode_and_prefill, free, make_llm
from gpu_sanity import require_sane
from spec_eagle_smollm2 import requests

def best_wall(run, fn, repeats: int = 3) -> float:
    """The fastest of `repeats` synchronized wall times of fn() (the first run warms it up)."""
    fn()
    return min(run.wall(fn)[0] for _ in range(1 if run.dry_run else repeats))


# SmolLM2's step three ways on one engine, each beside the others in the same run: the CUDA graph
# of the forward alone with the sampler eager (the engine before the whole-step graph), the whole
# step one graph (fused elementwise kernels, head and sampler inside), and that with the host a
# step ahead (async_scheduling). On the CPU (the dry run) only the last two differ.
STEP_VARIANTS = (("forward graph, eager sampler", dict(fused=False, whole=False, overlap=False)),
                 ("whole-step graph, fused", dict(fused=True, whole=True, overlap=False)),
                 ("whole-step graph, fused, host overlapped", dict(fused=True, whole=True, overlap=True)))


def use_variant(llm, loop, fused: bool, whole: bool, overlap: bool) -> str:
    """Set the engine's step to one of STEP_VARIANTS (`loop`: the engine's OverlapLoop, built with
    async_scheduling=True); returns its decode path."""
    from llmopt.worker.cuda_graphs import GraphedDecode

    e = llm.llm_engine
    if isinstance(e.runner.backend, GraphedDecode):  # fresh graphs for each variant
        e.runner.backend = GraphedDecode(e.model, e.kv_cache, e.config.max_num_seqs,
                                         -(-e.max_model_len // e.block_size), fused=fused)
    e.runner.keep_hidden = not whole  # the runner's old path: the forward's graph, then logits and sampler
    e.overlap = loop if overlap else None
    b = e.runner.backend
    return b.path + (" (fused)" if getattr(b, "fused", False) else "")


def section_decode_speed(run) -> None:
    if not require_sane(run):
        return
    new, prompt_len = (8, 8) if run.dry_run else (256, 32)
    llm = make_llm(run, run.model, async_scheduling=True)
    loop = llm.llm_engine.overlap
    prompt = run.refs["greedy"]["prompts"][0][:prompt_len]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rows, tokens, by_step = [], {}, {}
    for name, variant in STEP_VARIANTS:
        path = use_variant(llm, loop, **variant)
        out = []
        seconds = best_wall(run, lambda: out.append(llm.generate([{"prompt_token_ids": prompt}], params,
                                                                 use_tqdm=False)[0].outputs[0].token_ids))
        tokens[name] = out[-1]
        by_step[name] = new / seconds
        rows.append([f"SmolLM2 bf16, batch 1, {name}: {new} tokens after a {prompt_len}-token prompt ({path})",
                     f"{new / seconds:,.0f} tokens/s ({1e3 * seconds / new:.2f} ms a token)", "-"])
    numbers = {"smollm2_bf16_batch1_tok_s": max(by_step.values()), "smollm2_batch1_tok_s_by_step": by_step}
    base = STEP_VARIANTS[0][0]
    others = [t for name, t in tokens.items() if name != base]
    gaps = forced_gaps(llm, [prompt] * len(others), others)
    gap = float(gaps.max()) if len(gaps) else 0.0
    run.check(f"the fused, whole-step and overlapped steps' tokens within {MAX_GAP} nats of the best "
              "(teacher-forced)", gap <= MAX_GAP,
              f"largest gap {gap:.3f}; identical to the forward graph's: "
              f"{sum(t == tokens[base] for t in tokens.values()) - 1}/{len(tokens) - 1}")
    llm = None  # the engine goes before the 8B shape's comes (free collects it)
    free()
    if run.has_time(10):
        shape = "tiny" if run.dry_run else "llama-3.1-8b"
        kw = {} if run.dry_run else {"gpu_memory_utilization": 0.6}  # 16 GB of bf16 weights
        dense = make_llm(run, shape, load_format="dummy", **kw)
        bw, peak = run.ceilings["bandwidth_GBps"], run.ceilings["bf16_TFLOPs"]
        decode = decode_and_prefill(run, dense, 1, *((8, 4) if run.dry_run else (32, 64)))
        prefill = decode_and_prefill(run, dense, *((2, 32, 1) if run.dry_run else (8, 2048, 1)))
        del dense
        free()
        numbers.update(dense8b_bf16_batch1_bw_share=decode["decode_GBps"] / bw,
                       prefill8b_tflops_share=prefill["prefill_TFLOPs"] / peak, dense8b=decode, prefill8b=prefill)
        rows += [[f"{shape} shape (random weights) bf16, decode at batch 1 ({decode['decode_steps']} steps)",
                  f"{decode['decode_GBps']:.0f} GB/s of weights + KV ({decode['decode_tokens_per_s']:,.0f} tokens/s)",
                  f"{100 * numbers['dense8b_bf16_batch1_bw_share']:.1f}% of {bw:.0f} GB/s"],
                 [f"{shape} shape, prefill of {prefill['prefill_tokens']:,} tokens",
                  f"{prefill['prefill_TFLOPs']:.1f} TFLOP/s", f"{100 * numbers['prefill8b_tflops_share']:.1f}% of {peak:.0f}"]]
    run.section.numbers.update(numbers)
    run.table("Decode and prefill against the roofline (the ceilings measured in `env`)",
              ["what", "measured", "share of the ceiling"], rows)
    run.check("SmolLM2 and the 8B shape measured", "prefill8b_tflops_share" in numbers,
              ", ".join(k for k in numbers if not isinstance(numbers[k], dict)))
    if run.dry_run:
        run.note("timed on the CPU in the dry run: not a measurement")


def batch1(run, llm, prompts, max_tokens) -> tuple[float, list[list[int]]]:
    """Seconds and greedy tokens of the prompts one at a time (batch 1), after one to warm up."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
    seconds, tokens = 0.0, []
    for p, sp in zip(prompts, params):
        dt, out = run.wall(lambda p=p, sp=sp: llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False))
        seconds += dt
        tokens.append(out[0].outputs[0].token_ids)
    return seconds, tokens


def section_speculation(run) -> None:
    from llmopt.bench.edit import edit_requests

    if not require_sane(run):
        return
    plain = make_llm(run, run.model)
    chat = requests(plain.tokenizer, "chat", 0)  # spec_eagle_smollm2.py's chat questions, templated
    edits = edit_requests(plain.tokenizer, *((2, 60) if run.dry_run else (8, 300)))
    workloads = {
        "n-gram, edit workload": ({"method": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 4},
                                  [r.prompt_token_ids for r in edits],
                                  [min(r.max_tokens, 16) if run.dry_run else r.max_tokens for r in edits]),
        "EAGLE, chat": ({"method": "eagle", "model": "tiny-eagle" if run.dry_run else "smollm2-eagle",
                         "num_speculative_tokens": 4},
                        [r.prompt_token_ids for r in chat[:2 if run.dry_run else 8]], [8 if run.dry_run else 128] * 8)}
    rows = []
    for name, (config, prompts, max_tokens) in workloads.items():
        if not run.has_time(10):
            break
        t0 = time.monotonic()
        plain_s, plain_tokens = batch1(run, plain, prompts, max_tokens)
        spec = make_llm(run, run.model, speculative_config=config)
        spec_s, spec_tokens = batch1(run, spec, prompts, max_tokens)
        del spec
        free()
        same, share = agreement(spec_tokens, plain_tokens)
        gaps = forced_gaps(plain, prompts, spec_tokens)
        gap = float(gaps.max()) if len(gaps) else 0.0
        run.check(f"{name}: every token within {MAX_GAP} nats of plain decoding's best (teacher-forced)",
                  gap <= MAX_GAP, f"largest gap {gap:.3f}; {same}/{len(prompts)} sequences identical to plain's")
        key = "ngram_edit_speedup_batch1" if name.startswith("n-gram") else "eagle_chat_speedup_batch1"
        run.section.numbers[key] = plain_s / spec_s
        tokens = sum(map(len, spec_tokens))
        rows.append([name, len(prompts), f"{tokens:,}", f"{tokens / plain_s:,.0f}", f"{tokens / spec_s:,.0f}",
                     f"{plain_s / spec_s:.2f}x", f"{same}/{len(prompts)}, {100 * share:.0f}%"])
        run.note(f"{name}: {time.monotonic() - t0:.1f} s")
    del plain
    free()
    run.table("Speculative decoding at batch 1 (SmolLM2 bf16, k = 4), each beside plain decoding on the same requests",
              ["method, workload", "requests", "tokens", "plain tokens/s", "speculative tokens/s", "speedup",
               "identical to plain (sequences, prefix)"], rows)
    run.check("both workloads measured", len(rows) == len(workloads), f"{len(rows)} of {len(workloads)}")
    if run.dry_run:
        run.note("timed on the CPU in the dry run: not a measurement")


# -- quantized decoding against bf16 (lessons 06 and 07 on a GPU) -----------------------------------------------
def rtn_w4a16(model, group_size: int = 128) -> None:
    """Every quantizable linear of `model` replaced, on its device, by RTN 4-bit weights with zero
    points in the GPTQ layout: the W4A16 engine of a shape with random weights (speed only; a trained
    model's W4A16 quality is smollm2-quality's)."""
    from llmopt.layers.quant.gptq import GPTQLinear
    from llmopt.quant.rtn import rtn_quantize

    for name in model.quantizable_linears():
        dense = model.get_submodule(name)
        q = rtn_quantize(dense.weight.data, 4, group_size, sym=False, min_zero=1)
        model.set_submodule(name, GPTQLinear.from_quantized(q, None if dense.bias is None else dense.bias.data,
                                                            dense.weight.dtype))
        del dense


QUANT_CONFIGS = {"bf16": {}, "W4A16 (RTN g128)": {"w4a16": True}, "FP8 weights": {"quantization": "fp8"}}


def quant_decode(run, model, batch: int, prompt_len: int, new: int, **kw) -> dict[str, dict]:
    """decode_and_prefill of `model` in each of QUANT_CONFIGS, one engine at a time."""
    out = {}
    for name, config in QUANT_CONFIGS.items():
        if not run.has_time(8):
            break
        config = dict(config)
        w4a16 = config.pop("w4a16", False)
        llm = make_llm(run, model, **kw, **config)
        if w4a16:
            rtn_w4a16(llm.llm_engine.model)
        out[name] = decode_and_prefill(run, llm, batch, prompt_len, new)
        if w4a16 and run.device == "cuda":  # which kernel ran: tinygemm, or the Triton kernel and why
            why = {m.why_not_tinygemm for m in llm.llm_engine.model.modules() if hasattr(m, "why_not_tinygemm")}
            run.check(f"{model} W4A16 ran through tinygemm", why == {None}, "; ".join(map(str, why - {None})))
        del llm
        free()
    return out


def section_quant_speed(run) -> None:
    if not require_sane(run):
        return
    rows, numbers, records = [], {}, []
    shape, kw = ("tiny", {}) if run.dry_run else ("llama-3.1-8b", {"gpu_memory_utilization": 0.6})
    runs = {(f"{shape} shape (random weights)", 1): quant_decode(run, shape, 1, *((8, 4) if run.dry_run else (32, 64)),
                                                                 load_format="dummy", **kw)}
    for batch in (1, 64):
        runs[("SmolLM2", batch)] = quant_decode(run, run.model, batch, *((8, 4) if run.dry_run else (32, 64)))
    for (model, batch), by in runs.items():
        base = by.get("bf16")
        for name, d in by.items():
            ratio = None if base is None else d["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            rows.append([model, batch, name, f"{d['weight_bytes'] / 1e9:.2f}", f"{d['decode_tokens_per_s']:,.0f}",
                         f"{d['decode_GBps']:.0f}", "-" if ratio is None else f"{ratio:.2f}x"])
            records.append({"model": model, "sequences": batch, "weights": name, "weight_bytes": d["weight_bytes"],
                            "decode_tokens_per_s": d["decode_tokens_per_s"], "vs_bf16": ratio})
            key = {"W4A16 (RTN g128)": "w4a16", "FP8 weights": "fp8w"}.get(name)
            if key and ratio is not None:
                numbers[f"{key}_vs_bf16_batch{batch}_{'8b' if model != 'SmolLM2' else 'smollm2'}"] = ratio
    run.section.numbers.update(numbers, rows=records)  # rows: what lessons 06 and 07 print (gpu_quant_speed)
    run.table("Decode with quantized weights against bf16 (each engine alone; weights + KV bytes per second)",
              ["model", "sequences", "weights", "GB of weights", "decode tokens/s", "GB/s", "vs bf16"], rows)
    smollm2 = [v for k, v in numbers.items() if k.endswith("smollm2")]
    run.check("SmolLM2 W4A16 and FP8 measured at 1 and 64 sequences", len(smollm2) == 4,
              ", ".join(f"{k} {v:.2f}" for k, v in numbers.items()))
    if run.dry_run:
        run.note("timed on the CPU in the dry run: not a measurement")
