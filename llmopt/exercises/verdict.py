"""Lesson 15's exercise: a claim's verdict from its measured figures, the scorecard's one rule.

A claim is scored by tests `(measured, op, bound)`, the bound set before the measurement and the
op saying which side bears the claim out (">=" and ">" where higher is better, "<=" and "<" where
lower is, strict or not at the bound). The claim holds when every test passes; one failing test
refutes it; a measurement this machine cannot make (None) leaves it to a GPU unless a test already
failed; and a GPU's claim that no GPU figure decides yet (`refutable=False`) is not refuted by a
shortfall here either. The check holds the learner's rule against the engine's `claim_verdict` on
the scorecard's claims from committed tables and on the edges; the live run re-scores the lesson's
whole scorecard with it and compares every row's verdict.
"""

from __future__ import annotations

import contextlib
import io
import json

from llmopt.exercises.base import Case, Exercise
from llmopt.viz.scorecard import Scorecard, claim_verdict


def claim_verdict_solution(tests: list[tuple[float | None, str, float]], refutable: bool = True) -> str:
    """"holds", "does not hold" or "needs a GPU" for a claim whose tests are (measured, op, bound)."""
    passes = {">=": lambda m, b: m >= b, ">": lambda m, b: m > b, "<=": lambda m, b: m <= b, "<": lambda m, b: m < b}
    missing = False
    for measured, op, bound in tests:
        if measured is None:
            missing = True                # not measurable here; a failing test still refutes the claim
        elif not passes[op](measured, bound):
            return "does not hold" if refutable else "needs a GPU"
    return "needs a GPU" if missing else "holds"


def committed_claims() -> list[tuple[str, list, bool]]:
    """(claim, tests, refutable) of the lesson's claims that read a committed table or the models'
    shapes, with the lesson's own bounds (its sections 2, 6, 10 and 11): the scorecard that can be
    rebuilt anywhere in a second."""
    from llmopt.kv_bytes import PRESETS, kv_bytes_per_token, mla_bytes_per_token
    from llmopt.viz import committed_result
    from llmopt.viz.scorecard import gpu_quality

    llama = PRESETS["Llama-2-70B"]
    gqa = kv_bytes_per_token(llama.num_layers, llama.num_kv_heads, llama.head_dim, 2) * 4096
    mha = kv_bytes_per_token(llama.num_layers, llama.num_attention_heads, llama.head_dim, 2) * 4096
    claims = [("70B at 4K tokens needs > 40 GB of KV", [(max(gqa, mha), ">", 40e9)], True)]
    precision = {r["name"]: r for r in json.loads(committed_result("precision_smollm2.json").read_text())["rows"]}
    fp32 = precision["fp32"]["perplexity"]
    best_int4 = min(("gptq4", "awq4", "gptq4-rot", "gptq4-rot-mse", "awq4-rot"),
                    key=lambda n: precision[n]["perplexity"])
    for claim, name, saved_claim, loss_limit in (("INT8: -50% memory, minimal loss", "int8", 0.50, 0.01),
                                                 ("INT4 (GPTQ / AWQ): -75% memory, small loss", best_int4, 0.75, 0.05),
                                                 ("FP8: -50% memory, almost no loss", "fp8-w", 0.50, 0.01),
                                                 ("NF4: -75% memory, small loss", "nf4", 0.75, 0.05)):
        row = precision[name]
        saved, loss = 1 - row["linear_bytes"] / row["fp16_linear_bytes"], row["perplexity"] / fp32 - 1
        claims.append((claim, [(abs(saved - saved_claim), "<=", 0.05), (loss, "<", loss_limit)], True))
    rows, _ = gpu_quality()
    claims.append(("the quality measured on a CPU holds on a GPU", [(None, "<=", 0.01)] if rows is None else
                   [(abs(r["vs_cpu"]), "<=", 0.01) for r in rows if r["cpu_perplexity"] is not None], True))
    speed = precision["gptq4"]["quant_seconds"] / precision["awq4"]["quant_seconds"]
    claims.append(("AWQ quantizes 10-20x faster than GPTQ", [(speed, ">=", 10)], True))
    shape = dict(num_layers=80, head_dim=128, dtype_bytes=2)
    mqa, gqa8, mha64 = (kv_bytes_per_token(num_kv_heads=n, **shape) for n in (1, 8, 64))
    ds = PRESETS["DeepSeek-V3"]
    mla = mla_bytes_per_token(ds.num_layers, ds.kv_lora_rank, ds.qk_rope_head_dim, 2)
    ds_mha = kv_bytes_per_token(ds.num_layers, ds.num_kv_heads, ds.head_dim, 2)
    claims.append(("GQA / MQA / MLA shrink the KV cache",
                   [(mqa, "<", gqa8), (gqa8, "<", mha64), (mla, "<", ds_mha)], True))
    claims.append(("the combined recipe: 5-8x throughput, TTFT < 200 ms", [(None, "<", 0.2)], True))
    return claims


# (note, tests, refutable): the edges of the rule.
EDGES = [
    ("higher is better, at the bound: >= passes", [(0.9, ">=", 0.9), (2.0, ">=", 2)], True),
    ("higher is better, at the bound: > fails", [(40e9, ">", 40e9)], True),
    ("lower is better, under the bound", [(0.004, "<", 0.01), (1.2, "<=", 1.5)], True),
    ("lower is better, over the bound", [(0.8, "<=", 1.5), (0.02, "<", 0.01)], True),
    ("lower is better, at the bound: <= passes", [(1.5, "<=", 1.5)], True),
    ("lower is better, at the bound: < fails", [(0.01, "<", 0.01)], True),
    ("a range: 5% <= share <= 15%, the share above it", [(0.2, ">=", 0.05), (0.2, "<=", 0.15)], True),
    ("a measurement missing (None): the claim needs a GPU", [(None, "<", 0.2)], True),
    ("a test passes, another is missing", [(6.5, ">=", 5), (None, "<", 0.2)], True),
    ("a test fails beside a missing one: refuted all the same", [(None, "<", 0.2), (3.0, ">=", 5)], True),
    ("a GPU's claim with no GPU figure (refutable=False), short here", [(1.4, ">=", 2)], False),
    ("a GPU's claim with no GPU figure (refutable=False), borne out here", [(2.3, ">=", 2)], False),
    ("a GPU's claim once a GPU figure counts (refutable=True), short", [(1.4, ">=", 2)], True),
]


def cases():
    for claim, tests, refutable in committed_claims():
        yield _case(f"the scorecard's claim '{claim}'", tests, refutable)
    for note, tests, refutable in EDGES:
        yield _case(note, tests, refutable)


def _case(note: str, tests: list, refutable: bool) -> Case:
    return Case({"tests": tests, "refutable": refutable}, claim_verdict(tests, refutable),
                lambda fn, t=tests, r=refutable: fn(list(t), r), note=note)


def committed_card() -> Scorecard:
    """The lesson's scorecard, restricted to the claims `committed_claims` rebuilds."""
    card = Scorecard()
    with contextlib.redirect_stdout(io.StringIO()):   # score() prints each row for the lesson; not here
        for claim, tests, refutable in committed_claims():
            card.score(claim, tests, "-", "rebuilt from the committed tables", source="committed", refutable=refutable)
    return card


def live(fn, card: Scorecard | None = None) -> str:
    """Re-score every row of `card` (the lesson's scorecard, or else `committed_card()`) with `fn`
    from the tests it was scored by, and set each verdict beside the engine's."""
    from llmopt.viz import format_table

    card = card or committed_card()
    rows = [r for r in card.rows if r.tests is not None]
    table, differ = [], 0
    for r in rows:
        yours = fn(list(r.tests), r.refutable)
        differ += yours != r.verdict
        table.append({"claim": r.claim, "the scorecard's verdict": r.verdict, "yours": yours,
                      "": "" if yours == r.verdict else "DIFFERS"})
    told = f" ({len(card.rows) - len(rows)} rows scored without tests left out)" if len(rows) < len(card.rows) else ""
    return (format_table(table) + f"\n\nyour function re-scored the scorecard's {len(rows)} claims{told}: "
            + ("every verdict equals the engine's." if not differ else f"{differ} verdicts DIFFER from the engine's."))


EXERCISE = Exercise("claim_verdict", 15, "a claim's verdict from its measured figures and the bounds set before",
                    cases, claim_verdict_solution, live)
