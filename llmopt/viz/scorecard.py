"""The article's claims, scored: each beside the figure that decides it and where that figure came from.

A claim is scored by the cell that measured it, on the learner's machine, or from a committed
table named as such (the table's own header names its machine):

    card = Scorecard()
    card.score("KV cache: O(n^2) -> O(n)", holds=grows_uncached and flat_cached,
               figure="per-token cost x3.9 from 128 to 512 tokens without it, x1.1 with it",
               reason="without a cache a token costs a forward over its whole context")

`holds=None` says that this machine cannot decide the claim (one made of a GPU, where no GPU
run that passed its checks is on record): the verdict is "needs a GPU".

A GPU figure comes only from a report whose model is the model: `gpu_report` reads the
committed GPU check (benchmarks/gpu_check.py) and accepts it only where its SmolLM2 passed the
greedy comparison with transformers and its perplexity is within `GPU_PPL_TOLERANCE` of the
CPU's fp32 baseline, so that a run on broken weights decides nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmopt.bench.common import machine

HOLDS, FAILS, NEEDS_GPU = "holds", "does not hold", "needs a GPU"
# Perplexities on different token counts of the same text differ by some percent; broken
# weights are off by orders of magnitude. A quarter tells the two apart.
GPU_PPL_TOLERANCE = 0.25


@dataclass
class Score:
    claim: str
    verdict: str
    figure: str
    reason: str
    source: str


class Scorecard:
    """The claims scored so far, in the order they were scored."""

    def __init__(self):
        self.rows: list[Score] = []

    def score(self, claim: str, holds: bool | None, figure: str, reason: str, source: str | None = None) -> None:
        """Record (and print) one claim's verdict: holds (True), does not hold (False) or needs a GPU
        (None); `source` says where `figure` comes from (default: measured here, on this machine)."""
        if not (holds is True or holds is False or holds is None):
            raise TypeError(f"holds must be True, False or None (needs a GPU), got {holds!r}")
        for name, text in (("claim", claim), ("figure", figure), ("reason", reason)):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{name} must be a non-empty sentence, got {text!r}")
        verdict = NEEDS_GPU if holds is None else HOLDS if holds else FAILS
        row = Score(claim, verdict, figure, reason, source or f"measured here ({machine()})")
        self.rows = [r for r in self.rows if r.claim != claim] + [row]   # a rerun cell replaces its row
        print(f"{claim}: {verdict.upper()}. {figure} ({reason}). Source: {row.source}.")

    def counts(self) -> dict[str, int]:
        return {v: sum(r.verdict == v for r in self.rows) for v in (HOLDS, FAILS, NEEDS_GPU)}

    def table(self) -> list[dict]:
        return [{"claim": r.claim, "verdict": r.verdict, "figure": r.figure, "why": r.reason, "source": r.source}
                for r in self.rows]


def gpu_report(path: Path | None = None, cpu_fp32_perplexity: float | None = None) -> tuple[dict | None, str]:
    """(the committed GPU report, why it counts), or (None, why it does not).

    path: the report's JSON (default: the committed benchmarks/results/gpu_check.json).
    cpu_fp32_perplexity: the CPU's SmolLM2 perplexity to hold the GPU's against (default: the fp32
        row of the committed precision table, llmopt.eval.PROTOCOL)."""
    from llmopt.package_data import committed_result

    try:
        report = json.loads((path or committed_result("gpu_check.json")).read_text())
    except FileNotFoundError:
        return None, "no GPU report is committed"
    if cpu_fp32_perplexity is None:
        precision = json.loads(committed_result("precision_smollm2.json").read_text())
        cpu_fp32_perplexity = next(r["perplexity"] for r in precision["rows"] if r["name"] == "fp32")
    sections = {s["name"]: s for s in report.get("sections", [])}
    greedy, fp8 = sections.get("smollm2-greedy"), sections.get("smollm2-fp8")
    if greedy is None or greedy.get("status") != "ok":
        return None, "its SmolLM2 greedy comparison with transformers did not pass"
    gpu_ppl = ((fp8 or {}).get("numbers") or {}).get("bf16", {}).get("perplexity")
    if gpu_ppl is None:
        return None, "it has no SmolLM2 perplexity to hold against the CPU's"
    if abs(gpu_ppl / cpu_fp32_perplexity - 1) > GPU_PPL_TOLERANCE:
        return None, (f"its SmolLM2 scored perplexity {gpu_ppl:,.1f} against the CPU's {cpu_fp32_perplexity:.2f}: "
                      "its weights were not SmolLM2's, so its timings decide nothing")
    return report, (f"on {report.get('device_name', 'a GPU')}, its SmolLM2 within {GPU_PPL_TOLERANCE:.0%} of the "
                    f"CPU's perplexity ({gpu_ppl:.2f} vs {cpu_fp32_perplexity:.2f})")
