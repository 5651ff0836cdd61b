"""The block-table view: which KV blocks each request holds, step by step (PagedAttention).

The engine's trace records every request's block table after each step: the physical
blocks that hold its keys and values, in order. Drawn side by side with the block pool,
it shows what paging does: a request's blocks are scattered, blocks freed by a finished
request are handed to the next one, and (with prefix caching) one block can sit in
several tables at once. `pool_state` adds what the trace leaves out: ref counts, which
free blocks still hold a cached prefix, and the order the pool will evict them in.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmopt.viz.notebook import LABEL_STYLE, LEGEND_BELOW, LessonWidget, format_table, show_outputs

# Request colours repeat after ten; free blocks are grey, free blocks holding a cached prefix pale.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
FREE_COLOR, CACHED_COLOR, SHARED_COLOR = "#e8e8e8", "#fbe7a1", "#222222"


def pool_state(block_manager) -> dict:
    """A snapshot of the pool the trace does not hold: each block's ref count, the blocks
    whose contents are registered in the prefix cache, and the free queue in eviction order."""
    return {"ref_cnt": list(block_manager.ref_cnt),
            "cached": block_manager.cached_block_ids(),
            "free_queue": list(block_manager.free_queue)}


def tokens_in_cache(trace: list[dict], step: int) -> dict[str, int]:
    """request id -> tokens whose KV is stored after trace entry `step` (running requests only)."""
    tokens: dict[str, int] = {}
    for entry in trace[:step + 1]:
        for s in entry["scheduled"]:
            tokens[s["request_id"]] = s["context_len"] + s["num_tokens"]
        for rid in entry["preempted"] + entry["finished"]:
            tokens.pop(rid, None)
    return {rid: tokens.get(rid, 0) for rid in trace[step]["block_tables"]}


def block_states(entry: dict) -> list[dict]:
    """One row per physical block: who holds it, its ref count, and its state.

    state: "used" (one request), "shared" (several), "cached" (free, but its contents are
    still a valid prefix a new request can reuse), "free". Without a `pool` snapshot in the
    entry, ref counts come from the block tables and no free block counts as cached.
    """
    owners: dict[int, list[str]] = {}
    for rid, table in entry["block_tables"].items():
        for b in table:
            owners.setdefault(b, []).append(rid)
    pool = entry.get("pool")
    cached = set(pool["cached"]) if pool else set()
    rows = []
    for b in range(entry["num_blocks"]):
        held = owners.get(b, [])
        ref = pool["ref_cnt"][b] if pool else len(held)
        state = ("shared" if ref > 1 else "used") if ref else ("cached" if b in cached else "free")
        rows.append({"block": b, "ref_cnt": ref, "state": state, "owners": held, "hashed": b in cached})
    return rows


def block_table_rows(trace: list[dict], step: int, block_size: int | None = None) -> list[dict]:
    """The block tables after one step, one row per running request."""
    entry = trace[step]
    tokens = tokens_in_cache(trace, step)
    refs = {r["block"]: r["ref_cnt"] for r in block_states(entry)}
    kinds = {s["request_id"]: s["kind"] for s in entry["scheduled"]}
    rows = []
    for rid, table in entry["block_tables"].items():
        row = {"request": rid, "this step": kinds.get(rid, "-"), "tokens": tokens[rid],
               "blocks": len(table), "block table": _fmt_table(table, refs)}
        if block_size:
            row["empty slots"] = len(table) * block_size - tokens[rid]
        rows.append(row)
    return rows


def _fmt_table(table: list[int], refs: dict[int, int]) -> str:
    # a shared block shows its ref count: 3(2) is block 3, held by two requests
    return "[" + ", ".join(f"{b}({refs[b]})" if refs.get(b, 1) > 1 else str(b) for b in table) + "]"


def block_table_text(trace: list[dict], step: int, block_size: int | None = None) -> str:
    """The plain-text form of the view: the step's work, every block table, the pool."""
    entry = trace[step]
    lines = [f"step {step} of {len(trace) - 1}: " + _describe_step(entry)]
    rows = block_table_rows(trace, step, block_size)
    lines.append(format_table(rows) if rows else "(no request holds blocks)")
    states = block_states(entry)
    count = {k: sum(r["state"] == k for r in states) for k in ("used", "shared", "cached", "free")}
    pool = (f"pool: {entry['num_blocks']} blocks: {count['used'] + count['shared']} held "
            f"({count['shared']} shared), {count['cached'] + count['free']} free")
    if count["cached"]:
        pool += f", of which {count['cached']} still hold a cached prefix"
    if count["shared"]:
        pool += "; a shared block shows as id(ref count)"
    lines.append(pool)
    if entry["blocks_allocated"] or entry["blocks_freed"]:
        lines.append(f"this step allocated {_ids(entry['blocks_allocated'])}, freed {_ids(entry['blocks_freed'])}")
    if "pool" in entry and count["cached"]:
        queue = [b for b in entry["pool"]["free_queue"] if b in set(entry["pool"]["cached"])]
        lines.append(f"free blocks holding a cached prefix, in eviction order: {_ids(queue)}")
    return "\n".join(lines)


def _ids(ids: list[int]) -> str:
    return "[" + ", ".join(map(str, ids)) + "]" if ids else "none"


def _describe_step(entry: dict) -> str:
    parts = []
    for kind in ("prefill", "decode"):
        got = [s for s in entry["scheduled"] if s["kind"] == kind]
        if got:
            parts.append(f"{kind} " + ", ".join(
                f"{s['request_id']}" + (f" ({s['num_tokens']} tokens)" if kind == "prefill" else "")
                for s in got))
    if entry["preempted"]:
        parts.append("preempted " + ", ".join(entry["preempted"]))
    if entry["finished"]:
        parts.append("finished " + ", ".join(entry["finished"]))
    return "; ".join(parts) or "idle"


def request_colors(trace: list[dict]) -> dict[str, str]:
    """A fixed colour per request, in order of first appearance, the same at every step."""
    colors: dict[str, str] = {}
    for entry in trace:
        for rid in list(entry["block_tables"]) + [s["request_id"] for s in entry["scheduled"]]:
            if rid not in colors:
                colors[rid] = PALETTE[len(colors) % len(PALETTE)]
    return colors


def block_table_figure(trace: list[dict], step: int, columns: int = 16, max_blocks: int = 256,
                       colors: dict[str, str] | None = None) -> go.Figure:
    """Left: each request's block table (logical block i -> physical block id). Right: the pool.

    A shared block is outlined in black and labelled with its ref count; a free block that
    still holds a cached prefix is pale yellow.
    """
    entry = trace[step]
    colors = colors or request_colors(trace)
    states = block_states(entry)[:max_blocks]
    tables = entry["block_tables"]
    refs = {r["block"]: r["ref_cnt"] for r in states}
    width = max([len(t) for t in tables.values()] + [4])
    fig = make_subplots(rows=1, cols=2, column_widths=[0.42, 0.58], horizontal_spacing=0.06,
                        subplot_titles=("block tables: logical block -> physical block",
                                        f"block pool ({entry['num_blocks']} blocks)"))
    # left: one row of cells per request
    for rid, table in tables.items():
        fig.add_trace(go.Scatter(
            x=list(range(len(table))), y=[rid] * len(table), mode="markers+text",
            marker=dict(symbol="square", size=26, color=colors.get(rid, "#888"),
                        line=dict(width=[3 if refs.get(b, 1) > 1 else 0 for b in table], color=SHARED_COLOR)),
            text=[str(b) for b in table], textfont=dict(color="white", size=10),
            name=rid, legendgroup=rid, showlegend=False,
            hovertext=[f"{rid}: logical block {i} -> physical block {b} (ref count {refs.get(b, 1)})"
                       for i, b in enumerate(table)], hoverinfo="text"), row=1, col=1)
    # right: the pool as a grid, one trace per colour so the legend names them
    groups: dict[str, list[dict]] = {}
    for r in states:
        key = r["owners"][0] if r["owners"] else r["state"]
        groups.setdefault(key, []).append(r)
    order = [k for k in colors if k in groups] + [k for k in ("cached", "free") if k in groups]
    for key in order:
        cells = groups[key]
        label = {"cached": "free, cached prefix", "free": "free"}.get(key, key)
        color = {"cached": CACHED_COLOR, "free": FREE_COLOR}.get(key, colors.get(key, "#888"))
        fig.add_trace(go.Scatter(
            x=[r["block"] % columns for r in cells], y=[r["block"] // columns for r in cells],
            mode="markers+text", name=label, legendgroup=key,
            marker=dict(symbol="square", size=26, color=color,
                        line=dict(width=[3 if r["ref_cnt"] > 1 else 0 for r in cells], color=SHARED_COLOR)),
            text=[f"{r['block']}" + (f"<br>({r['ref_cnt']})" if r["ref_cnt"] > 1 else "") for r in cells],
            textfont=dict(color="black" if key in ("cached", "free") else "white", size=9),
            hovertext=[f"block {r['block']}: {r['state']}, ref count {r['ref_cnt']}"
                       + (f", held by {', '.join(r['owners'])}" if r["owners"] else "") for r in cells],
            hoverinfo="text"), row=1, col=2)
    grid_rows = -(-len(states) // columns)
    fig.update_xaxes(range=[-0.7, width - 0.3], dtick=1, title_text="logical block", row=1, col=1)
    fig.update_yaxes(autorange="reversed", type="category", row=1, col=1)
    fig.update_xaxes(range=[-0.7, columns - 0.3], showticklabels=False, showgrid=False, zeroline=False,
                     row=1, col=2)
    fig.update_yaxes(range=[grid_rows - 0.3, -0.7], showticklabels=False, showgrid=False,
                     zeroline=False, row=1, col=2)
    fig.update_layout(title=f"after step {step}: {_describe_step(entry)}"[:110],
                      height=max(330, 140 + 34 * max(len(tables), grid_rows)),
                      margin=dict(l=60, r=10, t=70, b=110), legend=LEGEND_BELOW)
    return fig


def block_table_widget(trace: list[dict], block_size: int | None = None, step: int = 0,
                       title: str = "block tables, step by step") -> LessonWidget:
    """A slider (and play button) over the steps of a traced run; figure and text redraw."""
    colors = request_colors(trace)
    slider = widgets.IntSlider(style=LABEL_STYLE, value=step, min=0, max=len(trace) - 1, description="step",
                               continuous_update=False, layout=widgets.Layout(width="60%"))
    play = widgets.Play(value=step, min=0, max=len(trace) - 1, interval=700, description="play")
    widgets.jslink((play, "value"), (slider, "value"))
    out = widgets.Output()

    def redraw(*_):
        show_outputs(out, block_table_figure(trace, slider.value, colors=colors),
                     block_table_text(trace, slider.value, block_size))

    slider.observe(redraw, names="value")
    redraw()
    return LessonWidget(title, [widgets.HBox([play, slider]), out])
