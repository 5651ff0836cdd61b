"""The article's claims, scored: each beside the figure that decides it and where that figure came from.

A claim is scored by the cell that measured it, on the learner's machine, or from a committed
table named as such (the table's own header names its machine):

    card = Scorecard()
    card.score("KV cache: O(n^2) -> O(n)", [(growth_uncached, ">=", 2), (growth_cached, "<=", 1.5)],
               figure="per-token cost x3.9 from 128 to 512 tokens without it, x1.1 with it",
               reason="without a cache a token costs a forward over its whole context")

A claim is the tests its figures must pass, each `(measured, op, bound)`, the bound set before the
measurement; `claim_verdict` turns them into the verdict. A measurement of None is one this
machine cannot make (a GPU's, where no GPU run that passed its checks is on record): unless a
test already fails, the verdict is "needs a GPU".

A GPU figure comes only from a report whose model is the model. `gpu_report` reads the committed
GPU check (benchmarks/gpu_check.py) and accepts it only where it ran on a GPU (not its CPU dry
run) and its `smollm2-sanity` section passed: the GPU's SmolLM2, loaded from the real GGUF file,
matched the references computed on the CPU, so that a run on broken weights decides nothing.
`gpu_quality` returns that report's SmolLM2 quality table (perplexity and greedy tokens of bf16,
fp16, FP8 and W4A16 on the GPU, each beside the CPU's same configuration) where its section passed
too. Both say in one sentence why a report counts or why not, for a lesson to print.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from pathlib import Path

from llmopt.bench.common import machine

HOLDS, FAILS, NEEDS_GPU = "holds", "does not hold", "needs a GPU"
# A test's op says which side of the bound bears the claim out (higher or lower is better), and
# whether the bound itself does.
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
# How a section that did not pass ended, in words (benchmarks/gpu_check.py's statuses).
_ENDED = {"failed": "failed", "error": "stopped on an error", "timeout": "ran out of time",
          "skipped": "was skipped", "not run": "did not run"}


def claim_verdict(tests: list[tuple[float | None, str, float]], refutable: bool = True) -> str:
    """A claim's verdict from its tests `(measured, op, bound)`: it holds when every measured value
    passes `measured op bound`; one that fails refutes it, even beside a measurement that is missing
    (None); otherwise a missing one leaves it to a GPU. `refutable=False`: a GPU's claim that no GPU
    figure decides yet, so a shortfall measured here is not a refutation either."""
    passed = [None if measured is None else OPS[op](measured, bound) for measured, op, bound in tests]
    if False in passed:
        return FAILS if refutable else NEEDS_GPU
    return NEEDS_GPU if None in passed else HOLDS


@dataclass
class Score:
    claim: str
    verdict: str
    figure: str
    reason: str
    source: str
    tests: list | None = None     # the (measured, op, bound) tests that decided it, where the claim gave them
    refutable: bool = True


class Scorecard:
    """The claims scored so far, in the order they were scored."""

    def __init__(self):
        self.rows: list[Score] = []

    def score(self, claim: str, holds: list | bool | None, figure: str, reason: str, source: str | None = None,
              refutable: bool = True) -> None:
        """Record (and print) one claim's verdict. `holds`: the claim's tests [(measured, op, bound), ...]
        (the verdict is `claim_verdict(holds, refutable)`), or a verdict decided by the caller: holds
        (True), does not hold (False) or needs a GPU (None). `source` says where `figure` comes from
        (default: measured here, on this machine)."""
        tests = None
        if isinstance(holds, list):
            tests = [_test(t) for t in holds]
            holds = {HOLDS: True, FAILS: False, NEEDS_GPU: None}[claim_verdict(tests, refutable)]
        if not (holds is True or holds is False or holds is None):
            raise TypeError(f"holds must be a list of (measured, op, bound) tests, or True, False or None "
                            f"(needs a GPU), got {holds!r}")
        for name, text in (("claim", claim), ("figure", figure), ("reason", reason)):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{name} must be a non-empty sentence, got {text!r}")
        verdict = NEEDS_GPU if holds is None else HOLDS if holds else FAILS
        row = Score(claim, verdict, figure, reason, source or f"measured here ({machine()})", tests, refutable)
        self.rows = [r for r in self.rows if r.claim != claim] + [row]   # a rerun cell replaces its row
        print(f"{claim}: {verdict.upper()}. {figure} ({reason}). Source: {row.source}.")

    def counts(self) -> dict[str, int]:
        return {v: sum(r.verdict == v for r in self.rows) for v in (HOLDS, FAILS, NEEDS_GPU)}

    def table(self) -> list[dict]:
        return [{"claim": r.claim, "verdict": r.verdict, "figure": r.figure, "why": r.reason, "source": r.source}
                for r in self.rows]


def _test(test) -> tuple[float | None, str, float]:
    """A (measured, op, bound) test, checked (numbers as plain floats, so that a row can be replayed)."""
    if not (isinstance(test, tuple) and len(test) == 3 and test[1] in OPS):
        raise TypeError(f"a test is (measured, op, bound) with op one of {', '.join(OPS)}, got {test!r}")
    measured, op, bound = test
    return (None if measured is None else float(measured)), op, float(bound)


def _section_failed(report: dict, name: str, what: str) -> str | None:
    """Why section `name` of `report` does not count (None where its status is "ok")."""
    section = next((s for s in report.get("sections", []) if s.get("name") == name), None)
    if section is None:
        return f"it has no {name} section"
    status = section.get("status")
    if status == "ok":
        return None
    failed = [f"{c.get('name')}: {c.get('detail')}" for c in section.get("checks", []) if not c.get("ok")]
    return f"{what} {_ENDED.get(status, repr(status))}" + (f" ({'; '.join(failed[:2])})" if failed else "")


def gpu_report(path: Path | None = None) -> tuple[dict | None, str]:
    """(the committed GPU report, why it counts), or (None, why it does not).

    path: the report's JSON (default: the committed benchmarks/results/gpu_check.json). A report
    counts where `dry_run` is false and its `smollm2-sanity` section's status is "ok"."""
    from llmopt.package_data import committed_result

    try:
        report = json.loads((path or committed_result("gpu_check.json")).read_text())
    except FileNotFoundError:
        return None, "no GPU report is committed"
    if report.get("dry_run") is not False:
        return None, ("it is a dry run on the CPU, not a run on a GPU" if report.get("dry_run") else
                      "it does not say that it ran on a GPU (no dry_run: false)")
    sections = {s.get("name"): s for s in report.get("sections", [])}
    if "smollm2-sanity" not in sections:
        # The reports from before the check rebuilt SmolLM2 from a lossy copy of its weights; the
        # bf16 perplexity they recorded shows how far from the model that was.
        old = ((sections.get("smollm2-fp8") or {}).get("numbers") or {}).get("bf16") or {}
        ppl = f" (perplexity {old['perplexity']:,.0f})" if isinstance(old.get("perplexity"), (int, float)) else ""
        return None, ("it was made before the GPU's SmolLM2 was checked against the CPU's references: "
                      f"its SmolLM2 was a lossy rebuild{ppl}, so its figures decide nothing")
    failed = _section_failed(report, "smollm2-sanity", "its SmolLM2 check against the CPU's references")
    if failed:
        return None, failed + ", so its figures decide nothing"
    return report, (f"made on {report.get('device_name', 'a GPU')} by benchmarks/gpu_check.py, its SmolLM2 "
                    "checked against the CPU's references")


def _section_rows(path: Path | None, name: str, what: str) -> tuple[list[dict] | None, str]:
    """(the rows of section `name` of the committed GPU report, the device's name), or (None, why
    not): the report must count (`gpu_report`) and the section have passed."""
    report, why = gpu_report(path)
    if report is None:
        return None, why
    failed = _section_failed(report, name, what)
    if failed:
        return None, failed
    section = next(s for s in report["sections"] if s.get("name") == name)
    rows = (section.get("numbers") or {}).get("rows")
    if not rows:
        return None, f"{what} has no rows"
    return rows, report.get("device_name", "a GPU")


def gpu_quant_speed(path: Path | None = None) -> tuple[list[dict] | None, str]:
    """(the GPU's decode speeds with quantized weights, a sentence naming the device), or (None, why not).

    Each row (benchmarks/gpu_check.py's quant-speed section): model (the 8B shape with random
    weights, or SmolLM2), sequences, weights ("bf16", "W4A16 (RTN g128)", "FP8 weights"),
    weight_bytes, decode_tokens_per_s, vs_bf16. They count where the report does (`gpu_report`)
    and its quant-speed section's status is "ok"."""
    rows, device = _section_rows(path, "quant-speed", "its quantized decode speed section")
    if rows is None:
        return None, device
    return rows, f"measured on {device} by benchmarks/gpu_check.py, each engine alone"


def gpu_speed_table(weights: str, path: Path | None = None) -> str:
    """What lessons 06 and 07 print: the GPU's decode speeds of bf16 and `weights` ("W4A16" or "FP8")
    side by side with the device named, or why no such table counts yet."""
    from llmopt.viz.notebook import format_table

    rows, why = gpu_quant_speed(path)
    if not rows:
        return (f"no GPU speed table counts yet (benchmarks/results/gpu_check.json: {why}).\n"
                "`python benchmarks/gpu_check.py` on a GPU makes one (benchmarks/README.md, \"On a GPU\").")
    table = format_table([{
        "model": r["model"], "sequences": r["sequences"], "weights": r["weights"],
        "GB of weights": r["weight_bytes"] / 1e9, "decode tokens/s": r["decode_tokens_per_s"],
        "vs bf16": "-" if r["vs_bf16"] is None else f"{r['vs_bf16']:.2f}x"}
        for r in rows if r["weights"] == "bf16" or r["weights"].startswith(weights)])
    return f"{table}\n\n{why}"


def gpu_quality(path: Path | None = None) -> tuple[list[dict] | None, str]:
    """(the GPU's SmolLM2 quality rows, a sentence naming the device), or (None, why not).

    Each row (benchmarks/gpu_check.py's smollm2-quality section) is one configuration: name,
    label, activations, perplexity, cpu_perplexity (the CPU's same configuration; None for bf16
    and fp16, held against the CPU's float32), the relative differences vs_cpu, vs_cpu_fp32 and
    vs_bf16 (perplexity / other's - 1), greedy_vs_bf16 {identical, of, prefix_share}, kv_blocks,
    kv_blocks_vs_bf16. The rows count where the report does (`gpu_report`) and its
    smollm2-quality section's status is "ok"."""
    rows, device = _section_rows(path, "smollm2-quality", "its SmolLM2 quality section")
    if rows is None:
        return None, device
    return rows, (f"measured on {device} by benchmarks/gpu_check.py, each row "
                  "checked against the CPU's same configuration")
