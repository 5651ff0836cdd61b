"""Per-token latency of a generation run, as a plot and as a table.

A sequence records the wall-clock time of each generated token; the gap between two tokens
is the cost of one engine step at that context length. Timings on a shared CPU are noisy,
so curves and tables use a rolling median, which keeps the trend and drops the spikes.
"""

from __future__ import annotations

import statistics

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmopt.viz.notebook import format_table


def per_token_latency(seq) -> tuple[list[int], list[float]]:
    """(context length, seconds) for every generated token of a finished `Sequence`.

    The first token's time runs from the start of the run (it includes the prompt's
    forward); token i's from token i-1. Context length is what the step attended over.
    """
    times = [seq.metrics.first_scheduled_time] + list(seq.metrics.token_times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    n_prompt = len(seq.prompt_token_ids)
    return [n_prompt + i for i in range(len(gaps))], gaps


def rolling_median(values: list[float], window: int = 9) -> list[float]:
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def latency_figure(runs: dict[str, tuple[list[int], list[float]]], window: int = 9,
                   max_points: int = 150) -> go.Figure:
    """Left: ms per token vs context length. Right: total seconds to generate n tokens."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time per token (rolling median)",
                                                        "total time to generate n tokens"))
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    for (name, (lengths, secs)), color in zip(runs.items(), colors):
        step = max(1, len(secs) // max_points)  # few points keep the stored figure small
        smooth = rolling_median(secs, window)
        total, acc = [], 0.0
        for s in secs:
            acc += s
            total.append(acc)
        idx = range(0, len(secs), step)
        fig.add_trace(go.Scatter(x=[lengths[i] for i in idx], y=[round(smooth[i] * 1e3, 3) for i in idx],
                                 name=name, mode="lines", line=dict(color=color)), row=1, col=1)
        fig.add_trace(go.Scatter(x=[i + 1 for i in idx], y=[round(total[i], 4) for i in idx],
                                 name=name, mode="lines", line=dict(color=color), showlegend=False),
                      row=1, col=2)
    fig.update_xaxes(title_text="context length (tokens)", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_xaxes(title_text="tokens generated", row=1, col=2)
    fig.update_yaxes(title_text="s", row=1, col=2)
    fig.update_layout(height=360, margin=dict(l=50, r=10, t=40, b=40),
                      legend=dict(orientation="h", y=-0.2))
    return fig


def latency_table(runs: dict[str, tuple[list[int], list[float]]], at: list[int],
                  window: int = 9) -> str:
    """ms per token near each context length in `at` (rolling median), one column per run."""
    rows = []
    for length in at:
        row = {"context length": length}
        for name, (lengths, secs) in runs.items():
            smooth = rolling_median(secs, window)
            near = [s for n, s in zip(lengths, smooth) if n == length]
            row[f"{name} ms/token"] = round(near[0] * 1e3, 2) if near else None
        rows.append(row)
    return format_table(rows)
