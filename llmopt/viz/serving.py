"""Serving dashboards: a load test's TTFT, TPOT, throughput and KV usage, live and after.

A `LoadTest` (llmopt.bench.load) fills in its request results and /metrics samples while it
runs. The same numbers draw a 2x2 dashboard (TTFT and TPOT per request, by when it was sent;
the server's output tokens/s and KV cache usage over time), a plot of the percentiles
against the request rate, and plain-text tables for viewers that draw neither.
"""

from __future__ import annotations

import time

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmopt.viz.notebook import LessonWidget, format_table, show_outputs

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def server_series(run) -> dict[str, list[float]]:
    """From the /metrics samples: time (s), output tokens/s between samples, KV usage (%), running."""
    s = [x for x in run.samples if "llmopt:generation_tokens_total" in x]
    out = {"time": [], "tokens_per_s": [], "kv_usage_pct": [], "running": [], "waiting": []}
    for a, b in zip(s, s[1:]):
        dt = b["time"] - a["time"]
        if dt <= 0:
            continue
        out["time"].append(round(b["time"], 3))
        out["tokens_per_s"].append(round((b["llmopt:generation_tokens_total"] - a["llmopt:generation_tokens_total"]) / dt, 1))
        out["kv_usage_pct"].append(round(100 * b["llmopt:kv_cache_usage_perc"], 2))
        out["running"].append(b["llmopt:num_requests_running"])
        out["waiting"].append(b["llmopt:num_requests_waiting"])
    return out


def dashboard_figure(runs: dict, title: str = "") -> go.Figure:
    """`runs`: label -> LoadTest (finished or still running). Times are seconds since each run began."""
    fig = make_subplots(rows=2, cols=2, vertical_spacing=0.16, horizontal_spacing=0.1,
                        subplot_titles=("TTFT per request (ms)", "TPOT per request (ms)",
                                        "server output tokens/s", "KV cache usage (%)"))
    for (label, run), color in zip(runs.items(), COLORS * 4):
        done = [r for r in list(run.results) if r.ok]
        sent = [round(r.send_time, 3) for r in done]
        fig.add_trace(go.Scatter(x=sent, y=[round(r.ttft * 1e3, 2) for r in done], mode="markers", name=label,
                                 legendgroup=label, marker=dict(color=color, size=5)), row=1, col=1)
        with_tpot = [r for r in done if r.tpot is not None]
        fig.add_trace(go.Scatter(x=[round(r.send_time, 3) for r in with_tpot],
                                 y=[round(r.tpot * 1e3, 2) for r in with_tpot], mode="markers", name=label,
                                 legendgroup=label, showlegend=False, marker=dict(color=color, size=5)),
                      row=1, col=2)
        series = server_series(run)
        fig.add_trace(go.Scatter(x=series["time"], y=series["tokens_per_s"], mode="lines", name=label,
                                 legendgroup=label, showlegend=False, line=dict(color=color)), row=2, col=1)
        fig.add_trace(go.Scatter(x=series["time"], y=series["kv_usage_pct"], mode="lines", name=label,
                                 legendgroup=label, showlegend=False, line=dict(color=color)), row=2, col=2)
    for row, col in ((1, 1), (1, 2), (2, 1), (2, 2)):
        fig.update_xaxes(title_text="s since the run began" + (" (request sent)" if row == 1 else ""),
                         row=row, col=col)
    fig.update_layout(height=560, title=title or None, margin=dict(l=50, r=10, t=60 if title else 40, b=40),
                      legend=dict(orientation="h", y=-0.12))
    return fig


def summary_rows(summaries: list[dict]) -> list[dict]:
    return [{"rate req/s": f"{s['rate']:g}", "offered req/s": s["offered_rate"], "served req/s": s["request_throughput"],
             "output tok/s": s["output_throughput"], "TTFT p50 ms": s["ttft_p50_ms"],
             "TTFT p90 ms": s["ttft_p90_ms"], "TTFT p99 ms": s["ttft_p99_ms"], "TPOT p50 ms": s["tpot_p50_ms"],
             "TPOT p90 ms": s["tpot_p90_ms"], "TPOT p99 ms": s["tpot_p99_ms"],
             "peak KV %": 100 * s.get("peak_kv_cache_usage", float("nan")), "failed": s["failed"]}
            for s in summaries]


def summary_figure(summaries: dict[str, list[dict]]) -> go.Figure:
    """`summaries`: label -> one summary per rate. Percentiles and throughput against the rate."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms): p50, p90, p99", "TPOT (ms): p50, p90, p99",
                                                        "output tokens/s"))
    for (label, runs), color in zip(summaries.items(), COLORS * 4):
        rates = [s["rate"] for s in runs]
        for col, metric in ((1, "ttft"), (2, "tpot")):
            for q, dash in ((50, "solid"), (90, "dash"), (99, "dot")):
                fig.add_trace(go.Scatter(x=rates, y=[round(s[f"{metric}_p{q}_ms"], 2) for s in runs],
                                         mode="lines+markers", name=f"{label} p{q}", legendgroup=label,
                                         showlegend=col == 1, line=dict(color=color, dash=dash)), row=1, col=col)
        fig.add_trace(go.Scatter(x=rates, y=[round(s["output_throughput"], 1) for s in runs], mode="lines+markers",
                                 name=label, legendgroup=label, showlegend=False, line=dict(color=color)),
                      row=1, col=3)
    fig.update_xaxes(title_text="request rate (req/s)", type="log")
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(height=380, margin=dict(l=50, r=10, t=40, b=40), legend=dict(orientation="h", y=-0.3))
    return fig


def live_dashboard(tests: list, interval: float = 0.5) -> list[dict]:
    """Run the load tests one after another, redrawing the dashboard every `interval` seconds
    while they run; return their summaries. The dashboard is a widget (it needs a running
    kernel); its last state is printed as a table beside it."""
    from IPython.display import display

    out = widgets.Output()
    display(LessonWidget("live load dashboard: TTFT, TPOT, throughput, KV usage", [out]))
    runs, summaries = {}, []
    for test in tests:
        runs[test.label] = test.start()
        while not test.done:
            time.sleep(interval)
            show_outputs(out, dashboard_figure(runs, title=f"running: {test.label}"),
                         f"{test.label}: {len(test.results)}/{len(test.requests)} requests done")
        summaries.append(test.wait())
    show_outputs(out, dashboard_figure(runs), format_table(summary_rows(summaries)))
    return summaries


def text_dashboard(runs: dict) -> str:
    """The dashboard's numbers as text: per run, the server's state at a few moments."""
    lines = []
    for label, run in runs.items():
        s = server_series(run)
        if not s["time"]:
            continue
        picks = sorted({round(i * (len(s["time"]) - 1) / 5) for i in range(6)})
        rows = [{"s": s["time"][i], "output tok/s": s["tokens_per_s"][i], "KV usage %": s["kv_usage_pct"][i],
                 "running": int(s["running"][i]), "waiting": int(s["waiting"][i])} for i in picks]
        lines.append(f"{label}:\n" + format_table(rows))
    return "\n\n".join(lines)
