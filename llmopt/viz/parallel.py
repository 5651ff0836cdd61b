"""Views for lesson 09: who holds which slice of each matrix, and when each pipeline stage ran.

`shard_rows` lists, per tensor-parallel rank, the heads and the rows or columns of every
matrix of a layer it holds (from the engine's own split in `llmopt.distributed.sharding`);
`shard_figure` draws each matrix as a bar cut into the ranks' slices; `shard_widget` lets
the learner pick a model and a TP size. `timeline_figure` / `timeline_text` draw the spans
each pipeline stage spent on each micro-batch, as the ranks measured them.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from llmopt.distributed.sharding import attention_heads, even_split, valid_tp_sizes
from llmopt.viz.notebook import LessonWidget, format_table, show_outputs

COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def shard_rows(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int, intermediate: int,
               vocab: int, tp: int) -> list[dict]:
    """One row per TP rank: its query and KV heads, and its slice of each matrix."""
    rows = []
    for r in range(tp):
        (q0, q1), (k0, k1) = attention_heads(num_heads, num_kv_heads, tp, r)
        i0, i1 = even_split(intermediate, tp, r)
        v0, v1 = even_split(vocab, tp, r)
        rows.append({"rank": r, "query heads": f"{q0}-{q1 - 1}", "KV heads": f"{k0}-{k1 - 1}",
                     "qkv rows": (q1 - q0 + 2 * (k1 - k0)) * head_dim, "o cols": (q1 - q0) * head_dim,
                     "gate_up rows": 2 * (i1 - i0), "down cols": i1 - i0, "vocab rows": v1 - v0,
                     "params/layer": hidden * ((q1 - q0 + 2 * (k1 - k0)) * head_dim + (q1 - q0) * head_dim
                                               + 3 * (i1 - i0))})
    return rows


def shard_figure(rows: list[dict], title: str = "") -> go.Figure:
    """Each matrix as a bar of its split dimension, coloured by the rank that holds each slice."""
    matrices = ["qkv rows", "o cols", "gate_up rows", "down cols", "vocab rows"]
    fig = go.Figure()
    for row in rows:
        fig.add_bar(y=matrices, x=[row[m] for m in matrices], orientation="h", name=f"rank {row['rank']}",
                    marker_color=COLORS[row["rank"] % len(COLORS)],
                    text=[f"{row[m]:,}" for m in matrices], textposition="inside")
    fig.update_layout(barmode="stack", height=300, title=title, xaxis_title="rows or columns held",
                      margin=dict(l=10, r=10, t=40, b=10), yaxis=dict(autorange="reversed"))
    return fig


def shard_widget(models: dict[str, dict], model: str | None = None, tp: int = 2) -> LessonWidget:
    """Pick a model (a dict of its config numbers) and a TP size; see each rank's share."""
    pick = widgets.Dropdown(options=list(models), value=model or next(iter(models)), description="model")
    size = widgets.Dropdown(description="TP size")
    out = widgets.Output()

    def sizes(*_):
        m = models[pick.value]
        options = [t for t in valid_tp_sizes(m["num_heads"], m["num_kv_heads"], 16)]
        size.options = options
        size.value = tp if tp in options else options[min(1, len(options) - 1)]

    def redraw(*_):
        if size.value is None:
            return
        rows = shard_rows(**models[pick.value], tp=size.value)
        show_outputs(out, format_table(rows), shard_figure(rows, f"{pick.value} at TP {size.value}"))

    pick.observe(sizes, "value")
    size.observe(redraw, "value")
    sizes()
    redraw()
    return LessonWidget("who holds which slice", [widgets.HBox([pick, size]), out])


def timeline_rows(reports: list[dict]) -> list[dict]:
    """The spans of TP rank 0 of every stage, relative to the first start, in ms."""
    spans = [(r["pp_rank"], mb, b, e) for r in reports if r["tp_rank"] == 0 for mb, b, e in r["timeline"]]
    t0 = min(s[2] for s in spans)
    return [{"stage": st, "micro-batch": mb, "start ms": 1e3 * (b - t0), "end ms": 1e3 * (e - t0)}
            for st, mb, b, e in sorted(spans, key=lambda s: (s[2], s[0]))]


def timeline_figure(runs: dict[str, list[dict]]) -> go.Figure:
    """One row per (run, stage): a bar per micro-batch where that stage computed it."""
    fig = go.Figure()
    for label, reports in runs.items():
        rows = timeline_rows(reports)
        for stage in sorted({r["stage"] for r in rows}):
            mine = [r for r in rows if r["stage"] == stage]
            fig.add_bar(base=[r["start ms"] for r in mine], x=[r["end ms"] - r["start ms"] for r in mine],
                        y=[f"{label}: stage {stage}"] * len(mine), orientation="h", showlegend=False,
                        marker_color=[COLORS[r["micro-batch"] % len(COLORS)] for r in mine],
                        hovertext=[f"micro-batch {r['micro-batch']}" for r in mine])
    fig.update_layout(barmode="overlay", height=120 + 60 * sum(len({r['pp_rank'] for r in v}) for v in runs.values()),
                      xaxis_title="ms since the first micro-batch started",
                      margin=dict(l=10, r=10, t=30, b=10), yaxis=dict(autorange="reversed"))
    return fig


def timeline_text(reports: list[dict], width: int = 100) -> str:
    """The same as characters: each stage a line, each micro-batch its digit (mod 10), '.' idle."""
    rows = timeline_rows(reports)
    end = max(r["end ms"] for r in rows)
    lines = []
    for stage in sorted({r["stage"] for r in rows}):
        line = ["."] * width
        for r in rows:
            if r["stage"] == stage:
                a, b = int(r["start ms"] / end * (width - 1)), int(r["end ms"] / end * (width - 1))
                for i in range(a, max(a, b) + 1):
                    line[i] = str(r["micro-batch"] % 10)
        lines.append(f"stage {stage} |{''.join(line)}|")
    return "\n".join(lines) + f"\n{'':8}0 ms{'':{width - 10}}{end:.0f} ms"
