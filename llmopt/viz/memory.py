"""Reserved versus used KV memory: contiguous preallocation against paging, and the block size.

A contiguous cache must reserve each request's worst case when it is admitted: the model's
whole context (`max_model_len`), or at best its prompt plus `max_tokens`. A paged cache
reserves one block at a time as tokens arrive, so the only slots it holds empty are the
unfilled tail of each request's last block. The block size trades that tail against the
length of the block tables (and, in lesson 04, how finely prefixes can be shared).
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmopt.viz.notebook import LABEL_STYLE, LessonWidget, format_table, show_outputs

BLOCK_SIZES = [8, 16, 32, 64, 128, 256]
STRATEGY_COLORS = {"contiguous, max_model_len each": "#d62728",
                   "contiguous, prompt + max_tokens each": "#ff7f0e",
                   "paged": "#1f77b4"}


def reservation_rows(trace: list[dict], max_model_len: int,
                     worst_case: dict[str, int] | None = None) -> list[dict]:
    """Per step: tokens actually stored, and the slots each strategy holds for the same requests.

    Paged is what the engine reserved (its blocks x block_size). The contiguous strategies hold,
    for every request from admission to finish, max_model_len slots, or `worst_case[request]`
    (prompt + max_tokens) when given.
    """
    rows = []
    for i, e in enumerate(trace):
        running = list(e["block_tables"])
        row = {"step": i, "running": len(running), "tokens stored": e["tokens_stored"],
               "paged": e["slots_reserved"],
               "contiguous, max_model_len each": len(running) * max_model_len}
        if worst_case is not None:
            row["contiguous, prompt + max_tokens each"] = sum(worst_case[r] for r in running)
        rows.append(row)
    return rows


def strategies(rows: list[dict]) -> list[str]:
    return [k for k in STRATEGY_COLORS if k in rows[0]]


def reservation_summary(rows: list[dict], bytes_per_token: int) -> list[dict]:
    """Per strategy: peak slots reserved, their bytes, and the share of reserved slots that held
    a token, summed over all steps (a slot reserved for 10 steps counts 10 times)."""
    stored = sum(r["tokens stored"] for r in rows)
    out = []
    for name in strategies(rows):
        peak = max(r[name] for r in rows)
        reserved = sum(r[name] for r in rows)
        out.append({"strategy": name, "peak slots reserved": peak,
                    "peak MB reserved": peak * bytes_per_token / 1e6,
                    "share of reserved slots used": stored / reserved if reserved else 0.0})
    return out


def reservation_text(rows: list[dict], bytes_per_token: int) -> str:
    summary = reservation_summary(rows, bytes_per_token)
    for r in summary:
        r["share of reserved slots used"] = f"{r['share of reserved slots used']:.1%}"
    peak_stored = max(r["tokens stored"] for r in rows)
    return (format_table(summary) + f"\npeak tokens actually stored: {peak_stored:,} "
            f"({peak_stored * bytes_per_token / 1e6:,.2f} MB)")


def reservation_figure(rows: list[dict]) -> go.Figure:
    """Left: slots reserved by each strategy and tokens stored, per step (log scale).
    Right: the share of reserved slots that hold a token, per step."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KV slots reserved vs tokens stored",
                                                        "share of reserved slots in use"))
    steps = [r["step"] for r in rows]
    for name in strategies(rows):
        color = STRATEGY_COLORS[name]
        fig.add_trace(go.Scatter(x=steps, y=[r[name] for r in rows], name=name, mode="lines",
                                 line=dict(color=color, shape="hv"), legendgroup=name), row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=[round(r["tokens stored"] / r[name], 4) if r[name] else None
                                             for r in rows],
                                 name=name, mode="lines", line=dict(color=color, shape="hv"),
                                 legendgroup=name, showlegend=False), row=1, col=2)
    fig.add_trace(go.Scatter(x=steps, y=[r["tokens stored"] for r in rows], name="tokens stored",
                             mode="lines", line=dict(color="black", dash="dot", shape="hv")), row=1, col=1)
    fig.update_yaxes(type="log", title_text="slots (tokens)", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=2)
    fig.update_xaxes(title_text="engine step")
    fig.update_layout(height=400, margin=dict(l=50, r=10, t=40, b=100), legend=dict(orientation="h", y=-0.25))
    return fig


# -- block size --------------------------------------------------------------------------------------
def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_size_rows(seq_lens: list[int], block_sizes: list[int] = BLOCK_SIZES,
                    shared_prefix: int = 0) -> list[dict]:
    """For sequences of these lengths: block-table entries, and slots reserved but empty
    (the tail of each last block). With a shared prefix, the part of it whole blocks cover,
    which is all prefix caching can share."""
    used = sum(seq_lens)
    rows = []
    for bs in block_sizes:
        entries = sum(blocks_needed(n, bs) for n in seq_lens)
        reserved = entries * bs
        row = {"block size": bs, "table entries": entries,
               "entries per request": entries / len(seq_lens),
               "empty slots": reserved - used, "waste": (reserved - used) / reserved}
        if shared_prefix:
            row["shareable prefix tokens"] = shared_prefix // bs * bs
        rows.append(row)
    return rows


def block_size_text(rows: list[dict]) -> str:
    shown = [{**r, "waste": f"{r['waste']:.1%}"} for r in rows]
    return format_table(shown)


def block_size_figure(seq_lens: list[int], block_size: int, rows: list[dict],
                      names: list[str] | None = None) -> go.Figure:
    """Left: each sequence's slots at this block size, stored vs empty. Right: waste and table
    entries against the block size, the chosen one marked."""
    names = names or [f"seq {i}" for i in range(len(seq_lens))]
    fig = make_subplots(rows=1, cols=2, specs=[[{}, {"secondary_y": True}]],
                        subplot_titles=(f"slots per sequence, block size {block_size}",
                                        "waste vs block-table size"))
    empty = [blocks_needed(n, block_size) * block_size - n for n in seq_lens]
    fig.add_trace(go.Bar(x=names, y=seq_lens, name="tokens stored", marker_color="#1f77b4"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=empty, name="reserved, empty", marker_color="#d62728"), row=1, col=1)
    sizes = [r["block size"] for r in rows]
    fig.add_trace(go.Scatter(x=sizes, y=[round(r["waste"], 4) for r in rows], name="waste (share of slots)",
                             mode="lines+markers", line=dict(color="#d62728")), row=1, col=2)
    fig.add_trace(go.Scatter(x=sizes, y=[r["table entries"] for r in rows], name="block-table entries",
                             mode="lines+markers", line=dict(color="#2ca02c", dash="dash")),
                  row=1, col=2, secondary_y=True)
    fig.add_vline(x=block_size, line_dash="dot", line_color="grey", row=1, col=2)
    fig.update_xaxes(type="log", tickvals=sizes, title_text="block size (tokens)", row=1, col=2)
    fig.update_yaxes(tickformat=".0%", title_text="waste", row=1, col=2, secondary_y=False)
    fig.update_yaxes(title_text="table entries", row=1, col=2, secondary_y=True)
    fig.update_layout(barmode="stack", height=400, margin=dict(l=50, r=50, t=40, b=100),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def block_size_widget(seq_lens: list[int], names: list[str] | None = None, block_size: int = 16,
                      block_sizes: list[int] = BLOCK_SIZES) -> LessonWidget:
    """Slide the block size; see each sequence's empty slots and the table it needs."""
    slider = widgets.SelectionSlider(style=LABEL_STYLE, options=block_sizes, value=block_size, description="block_size",
                                     continuous_update=False)
    out = widgets.Output()
    rows = block_size_rows(seq_lens, block_sizes)

    def redraw(*_):
        r = next(r for r in rows if r["block size"] == slider.value)
        text = (f"block size {r['block size']}: {r['table entries']:,} block-table entries for "
                f"{len(seq_lens)} sequences, {r['empty slots']:,} slots reserved but empty "
                f"({r['waste']:.1%} of the reserved slots)")
        show_outputs(out, block_size_figure(seq_lens, slider.value, rows, names), text)

    slider.observe(redraw, names="value")
    redraw()
    return LessonWidget("block size trade-off", [slider, out])
