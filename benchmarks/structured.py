"""Structured outputs on SmolLM2: validity at temperature 1, the mask's cost, jump-forward's speedup.

1. Validity: chat requests sampled at temperature 1 under three JSON schemas; the share of
   outputs that parse and validate against their schema (jsonschema), and how many ended.
2. Mask cost: the time to fill one request's bitmask (xgrammar) and apply it to the logits
   (llmopt/structured/bitmask.py), as a share of a batch-1 decode step measured in the same run.
3. Jump-forward: a schema-heavy workload (many fixed keys, enums, booleans), end to end, with
   and without jump-forward, same requests, same seeds; and the decode steps it saved.

    python benchmarks/structured.py                 # writes benchmarks/results/structured.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import jsonschema
import torch

from llmopt import LLM, SamplingParams, StructuredOutputsParams
from llmopt.structured.bitmask import apply_token_bitmask
from llmopt.structured.matcher import RequestGrammar

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"}},
        "required": ["name", "age", "email"]},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 3},
        "status": {"enum": ["pending", "shipped", "delivered"]}},
        "required": ["id", "items", "status"]},
    "review": {"type": "object", "properties": {
        "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "recommend": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 40}}, "required": ["stars", "recommend", "summary"]},
}
# schema-heavy: most of the output is keys and punctuation the grammar forces
HEAVY = {"type": "object", "properties": {
    "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
    "shipping_address_country_code": {"enum": ["US", "DE", "FR", "JP"]},
    "is_priority_customer_account": {"type": "boolean"},
    "preferred_contact_method_type": {"enum": ["email", "phone", "mail"]},
    "number_of_previous_orders_total": {"type": "integer", "minimum": 0, "maximum": 99},
    "subscription_plan_level_name": {"enum": ["free", "basic", "premium"]},
    "marketing_emails_opt_in_status": {"type": "boolean"},
    "account_creation_year_number": {"type": "integer", "minimum": 2000, "maximum": 2030}},
    "required": ["customer_account_identifier", "shipping_address_country_code", "is_priority_customer_account",
                 "preferred_contact_method_type", "number_of_previous_orders_total",
                 "subscription_plan_level_name", "marketing_emails_opt_in_status", "account_creation_year_number"]}


def chat(llm, name, n, seed0, max_tokens, schema, jump=True):
    llm.llm_engine.structured.enable_jump_forward = jump
    msgs = [[{"role": "user", "content": f"Write a {name} record as JSON."}]] * n
    params = [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(json=schema)) for i in range(n)]
    start = time.perf_counter()
    outs = llm.chat(msgs, params, use_tqdm=False)
    return outs, time.perf_counter() - start


def count_valid(outs, schema) -> int:
    """Outputs that parse as JSON and validate against `schema`."""
    ok = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


def validity(llm, n, max_tokens):
    rows = {}
    for name, schema in SCHEMAS.items():
        outs, _ = chat(llm, name, n, 0, max_tokens, schema)
        rows[name] = {"samples": n, "valid": count_valid(outs, schema), "ended_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs),
                      "example": outs[0].outputs[0].text}
    return rows


def mask_cost(llm, steps):
    engine = llm.llm_engine
    free = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    s0, t0 = engine.step_count, time.perf_counter()
    llm.generate(["Write a story about a cat."], free, use_tqdm=False)
    step_s = (time.perf_counter() - t0) / (engine.step_count - s0)
    # fill + apply for one request, walked through a real constrained output token by token
    [out], _ = chat(llm, "order", 1, 7, 128, SCHEMAS["order"], jump=False)
    compiled = engine.structured.compile(SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS["order"])))
    vocab = engine.model_config.vocab_size
    g = RequestGrammar(compiled, engine.eos_token_ids, vocab)
    import xgrammar as xgr

    bitmask, logits = xgr.allocate_token_bitmask(1, vocab), torch.randn(1, vocab)
    fill = apply = 0.0
    tokens = out.outputs[0].token_ids
    for t in tokens:
        a = time.perf_counter()
        g.fill(bitmask, 0)
        b = time.perf_counter()
        apply_token_bitmask(logits, bitmask, [0])
        c = time.perf_counter()
        fill, apply = fill + b - a, apply + c - b
        g.accept(t)
    n = len(tokens)
    return {"decode_step_ms": step_s * 1e3, "fill_ms": fill / n * 1e3, "apply_ms": apply / n * 1e3,
            "share": (fill + apply) / n / step_s, "tokens_walked": n}


def jump_forward(llm, n, max_tokens):
    engine = llm.llm_engine
    res = {}
    for jump in (False, True):
        m0, s0 = llm.get_metrics(), engine.step_count
        outs, wall = chat(llm, "customer", n, 100, max_tokens, HEAVY, jump=jump)
        m1 = llm.get_metrics()
        valid = count_valid(outs, HEAVY)
        res["jump" if jump else "plain"] = {
            "wall_s": wall, "steps": engine.step_count - s0, "valid": valid, "requests": n,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "jump_forward_tokens": m1["structured_jump_forward_tokens"] - m0["structured_jump_forward_tokens"],
            "retokenized": m1["structured_jump_forward_retokenized"] - m0["structured_jump_forward_retokenized"],
            "eos_steps_saved": m1["structured_eos_steps_saved"] - m0["structured_eos_steps_saved"]}
    res["speedup"] = res["plain"]["wall_s"] / res["jump"]["wall_s"]
    return res


def write(out_dir: Path, raw: dict) -> str:
    v, m, j = raw["validity"], raw["mask"], raw["jump_forward"]
    lines = [f"# Structured outputs on SmolLM2-135M-Instruct (xgrammar {raw['xgrammar']})", "",
             f"CPU: {raw['cpu']}; {raw['threads']} torch threads; load average at start {raw['load_before']}, "
             f"at end {raw['load_after']}. `{raw['command']}`", "",
             "## Validity: sampled at temperature 1, parsed and validated with jsonschema", "",
             "| schema | samples | parse and validate | ended with stop |", "|---|---|---|---|"]
    for name, r in v.items():
        lines.append(f"| {name} | {r['samples']} | {r['valid'] / r['samples']:.0%} ({r['valid']}) | {r['ended_stop']} |")
    total = sum(r["valid"] for r in v.values()), sum(r["samples"] for r in v.values())
    lines += [f"| all | {total[1]} | **{total[0] / total[1]:.0%}** | |", "",
              "## Mask cost per token (one request), against a batch-1 decode step", "",
              "| decode step | fill bitmask (xgrammar) | apply to logits | mask share of the step |",
              "|---|---|---|---|",
              f"| {m['decode_step_ms']:.1f} ms | {m['fill_ms']:.3f} ms | {m['apply_ms']:.3f} ms | "
              f"**{m['share']:.1%}** |", "",
              f"## Jump-forward: schema-heavy JSON ({j['plain']['requests']} chat requests, 8 long fixed keys), "
              "temperature 1", "",
              "| | wall | engine steps | output tokens | tokens appended by jump-forward | valid |",
              "|---|---|---|---|---|---|"]
    for k in ("plain", "jump"):
        r = j[k]
        lines.append(f"| {'without' if k == 'plain' else 'with'} jump-forward | {r['wall_s']:.1f} s | {r['steps']} | "
                     f"{r['tokens']} | {r['jump_forward_tokens']:.0f} | {r['valid']}/{r['requests']} |")
    lines += ["", f"Speedup end to end: **{j['speedup']:.2f}x**; boundary tokens re-encoded with the forced text: "
              f"{j['jump']['retokenized']:.0f}; EOS steps skipped where only EOS could follow: "
              f"{j['jump']['eos_steps_saved']:.0f}.", ""]
    text = "\n".join(lines)
    (out_dir / "structured.md").write_text(text)
    (out_dir / "structured.json").write_text(json.dumps(raw, indent=1))
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--jump-requests", type=int, default=8)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    from importlib.metadata import version

    raw = {"command": "python benchmarks/structured.py", "xgrammar": version("xgrammar"),
           "cpu": subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                                 text=True, check=False).stdout.split(":")[-1].strip(),
           "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()), "threads": torch.get_num_threads()}
    llm = LLM(model="smollm2", device="cpu", num_kv_blocks=512, seed=0)
    raw["validity"] = validity(llm, args.samples, 160)
    raw["mask"] = mask_cost(llm, 32)
    raw["jump_forward"] = jump_forward(llm, args.jump_requests, 200)
    raw["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(write(args.out_dir, raw))


if __name__ == "__main__":
    main()
