"""The roofline on the learner's machine: decode step time against batch size, beside its floor.

`llmopt.bench.roofline` measures; this draws. The floor of a decode step is the time to read
its bytes (weights once, plus each sequence's cached keys and values) at the machine's read
bandwidth; the gap between a path's curve and the floor is what per-op overhead and slow
kernels cost, and where the curve bends upward the step stops being memory-bound.
"""

from __future__ import annotations

import plotly.graph_objects as go

from llmopt.viz.notebook import LEGEND_BELOW


def roofline_rows(runs: dict[str, dict]) -> list[dict]:
    """One row per (path, batch size): step time, tokens/s, bytes read, GB/s and share of bandwidth."""
    rows = []
    for label, raw in runs.items():
        for r in raw["rows"]:
            rows.append({"decode path": label, "batch": r["batch"], "step ms": r["step_ms"], "tok/s": r["tok_s"],
                         "MB read": r["weight_mb"] + r["kv_mb"], "GB/s": r["gb_s"],
                         "share of DRAM bandwidth": f"{100 * r['share']:.0f}%",
                         "step vs batch 1": f"{r['vs_batch_1']:.2f}x"})
    return rows


def roofline_figure(runs: dict[str, dict]) -> go.Figure:
    """Step time per batch size for each decode path, and the floor the read bandwidth sets."""
    fig = go.Figure()
    any_raw = next(iter(runs.values()))
    bw = any_raw.get("dram_gb_s", any_raw["read_gb_s"])
    batches = [r["batch"] for r in any_raw["rows"]]
    floor = [(r["weight_mb"] + r["kv_mb"]) * 1e6 / (bw * 1e9) * 1e3 for r in any_raw["rows"]]
    fig.add_trace(go.Scatter(x=batches, y=floor, name=f"floor: bytes / {bw:.0f} GB/s", mode="lines",
                             line=dict(dash="dash", color="grey")))
    for label, raw in runs.items():
        fig.add_trace(go.Scatter(x=[r["batch"] for r in raw["rows"]], y=[r["step_ms"] for r in raw["rows"]],
                                 name=label, mode="lines+markers"))
    fig.update_layout(title="decode step time against batch size", xaxis=dict(title="sequences in the batch",
                      type="log"), yaxis=dict(title="ms per step", rangemode="tozero"), height=380,
                      legend=LEGEND_BELOW, margin=dict(t=50, b=40))
    return fig
