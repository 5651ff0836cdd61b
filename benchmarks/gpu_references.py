"""What the GPU must reproduce, computed on the CPU first: SmolLM2's greedy tokens, their
log-probabilities and its perplexity in float32, and each quantized configuration's perplexity.

A check that compares two systems on the GPU passes whenever both are wrong the same way (the
rebuilt SmolLM2 that scored perplexity 896,246 agreed with transformers token for token). These
are absolute: the CPU engine on the wheel's own GGUF, once, here, committed as a small file that
travels with the repository:

    python benchmarks/gpu_references.py      # here: writes benchmarks/gpu_references/smollm2.json

`benchmarks/gpu_check.py` holds every GPU section to them (the tolerances are its own). The file
also records the plan the GPU must follow to be comparable (prompts as token ids, the perplexity
protocol, the quantizers' settings) and the model file's sha256, so the GPU cannot measure
another model or another protocol by accident.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "gpu_references" / "smollm2.json"

# The configurations each GPU row is checked against, the same on both machines: engine
# arguments, or a checkpoint that `llmopt.quant.quantize` writes first (W4A16 at group 64:
# 576 = 9 x 64; groups of 32 would find the GGUF's own Q4_1 grid again; with zero points, as
# results/quant_smollm2.md quantizes, so that the three methods share a grid).
# FP8 weights run as W8A8 (activations rounded to fp8 per token): what a GPU with FP8 units does
# natively, so the CPU emulates the same (`round_fp8_activations`), not its own weight-only default.
CONFIGS = {
    "fp8-kv": ("FP8 e4m3 KV cache, calibrated scales", {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}, None),
    "fp8-w": ("FP8 e4m3 weights and activations (W8A8, per-token scales)", {"quantization": "fp8"}, None),
    "rtn4": ("W4A16, round to nearest, group 64 (GPTQ layout)", {},
             {"method": "rtn", "bits": 4, "group_size": 64, "sym": False}),
    "gptq4": ("W4A16, GPTQ, group 64", {}, {"method": "gptq", "bits": 4, "group_size": 64, "sym": False}),
    "awq4": ("W4A16, AWQ, group 64 (AWQ layout)", {}, {"method": "awq", "bits": 4, "group_size": 64}),
}


def plan_for(dry_run: bool) -> dict:
    """What is measured, and how much: SmolLM2's full plan, or a small one for the dry run's tiny model."""
    from llmopt.eval import PROTOCOL

    if dry_run:
        # max_model_len 128: an FP8 pool's calibration runs sequences of up to 512 tokens, no more
        # than the engine holds (set_kv_scales); the dry run's own sequences are shorter than 128
        return {"prompts": 4, "prompt_len": [8, 24], "new_tokens": 8, "ppl": {"max_tokens": 256, "seq_len": 64},
                "quantize": {"num_samples": 2, "seq_len": 64}, "twins": list(CONFIGS),
                "engine": {"max_model_len": 128}}
    return {"prompts": 16, "prompt_len": [32, 96], "new_tokens": 32, "ppl": dict(PROTOCOL),
            "quantize": {"num_samples": 4, "seq_len": 512}, "twins": list(CONFIGS), "engine": {}}


def model_file(model: str) -> Path:
    """The file whose bytes are the model: the GGUF, or a folder's model.safetensors."""
    from llmopt import model_path

    path = Path(model) if Path(model).exists() else model_path(model)
    return path if path.is_file() else path / "model.safetensors"


def file_sha256(path: Path) -> str:
    from gpu_carry import sha256

    return sha256(Path(path))


def engine(model: str, dtype, device: str = "cpu", **kw):
    from llmopt import LLM

    kw.setdefault("enable_prefix_caching", False)  # each measurement computes its own tokens
    if device == "cuda":
        kw.setdefault("gpu_memory_utilization", 0.15)  # far more KV than these runs use
    return LLM(model=str(model), dtype=dtype, device=device, **kw)


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and each one's log-probability under the engine that chose it."""
    from llmopt import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(toks, o.outputs[0].logprobs)] for toks, o in zip(tokens, outs)]
    return tokens, logprobs


def perplexity(llm, plan: dict) -> float:
    from llmopt.eval import perplexity as ppl

    return ppl(llm, max_tokens=plan["ppl"]["max_tokens"], seq_len=plan["ppl"]["seq_len"])


def configure(llm, name: str) -> None:
    """What a configuration sets after the engine is built (the same on both machines)."""
    if name == "fp8-w":
        from llmopt.fp8.linear import round_fp8_activations

        round_fp8_activations(llm.model, True)


def twin(model: str, name: str, dtype, plan: dict, work: Path, device: str = "cpu") -> tuple[float, float]:
    """(perplexity, seconds spent quantizing) of one configuration of CONFIGS."""
    from llmopt.quant import quantize

    _, kw, spec = CONFIGS[name]
    source, seconds = model, 0.0
    if spec is not None:
        out = work / name
        t0 = time.perf_counter()
        quantize(str(model), out=str(out), device=device, progress=False, **spec, **plan["quantize"])
        source, seconds = str(out), time.perf_counter() - t0
    llm = engine(source, dtype, device, **plan.get("engine", {}), **kw)
    configure(llm, name)
    value = perplexity(llm, plan)
    del llm
    return value, seconds


def compute(model: str, activations: torch.dtype, dry_run: bool = False, log=print, with_twins: bool = True) -> dict:
    """The references for `model`: float32 greedy tokens with log-probabilities and perplexity on
    the CPU, and (unless `with_twins` is False) each configuration of the plan's twins at `activations`."""
    from llmopt.bench import heldout_tokens, make_requests
    from llmopt.bench.common import machine

    plan = plan_for(dry_run)
    path = model_file(model)
    t0 = time.perf_counter()
    llm = engine(model, torch.float32)
    reqs = make_requests(heldout_tokens(llm.tokenizer), plan["prompts"], tuple(plan["prompt_len"]),
                         (plan["new_tokens"], plan["new_tokens"]), seed=0)
    prompts = [r.prompt_token_ids for r in reqs]
    tokens, logprobs = greedy(llm, prompts, plan["new_tokens"])
    fp32 = perplexity(llm, plan)
    log(f"float32: perplexity {fp32:.4f}, {len(tokens)} greedy sequences ({time.perf_counter() - t0:.0f} s)")
    del llm
    twins, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu_refs_") as work:
        for name in plan["twins"] if with_twins else ():
            t1 = time.perf_counter()
            twins[name], seconds[name] = twin(model, name, activations, plan, Path(work))
            log(f"{name} ({activations}): perplexity {twins[name]:.4f} ({time.perf_counter() - t1:.0f} s)")
    return {"model": str(model), "file": path.name, "sha256": file_sha256(path), "plan": plan,
            "machine": machine(), "torch": torch.__version__,
            "greedy": {"prompts": prompts, "tokens": tokens, "logprobs": logprobs},
            "perplexity": {"float32": fp32}, "twins": {"activations": str(activations).removeprefix("torch."),
                                                       "perplexity": twins, "quantize_seconds": seconds},
            "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    import argparse
    import os
    import sys

    sys.path.insert(0, str(HERE.parent))
    from llmopt.bench.common import machine

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--twins", nargs="+", choices=list(CONFIGS), metavar="CONFIG",
                    help=f"recompute only these configurations into the existing --out ({', '.join(CONFIGS)})")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if args.twins:
        refs = json.loads(args.out.read_text())
        if file_sha256(model_file(args.model)) != refs["sha256"]:
            ap.error(f"{args.out} was computed on another model file; recompute it whole")
        dtype = getattr(torch, refs["twins"]["activations"])
        with tempfile.TemporaryDirectory(prefix="gpu_refs_") as work:
            for name in args.twins:
                value, seconds = twin(args.model, name, dtype, refs["plan"], Path(work))
                refs["twins"]["perplexity"][name], refs["twins"]["quantize_seconds"][name] = value, seconds
                print(f"{name} ({dtype}): perplexity {value:.4f}")
        refs["recomputed"] = {"twins": args.twins, "load_average_1min_before": load, "machine": machine()}
        args.out.write_text(json.dumps(refs) + "\n")
        sys.exit(0)
    refs = compute(args.model, torch.bfloat16)
    refs["load_average_1min_before"] = load
    refs["command"] = "python benchmarks/gpu_references.py" + (f" --model {args.model}" if args.model != "smollm2" else "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(refs) + "\n")
    print(f"wrote {args.out} in {refs['seconds'] / 60:.1f} min")
