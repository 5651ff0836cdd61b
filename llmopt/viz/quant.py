"""Views for lesson 06: weights and their rounding error, the channels AWQ protects, and what
each quantization method costs in perplexity and saves in memory.

Each view is a function computing the numbers, a plotly figure (or an ipywidgets panel) showing
them, and a text table of the same numbers for viewers that draw neither.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from llmopt.quant.rtn import fake_quantize
from llmopt.viz.notebook import LABEL_STYLE, LEGEND_BELOW, LessonWidget, format_table, show_outputs

METHOD_COLORS = {"none": "#7f7f7f", "rtn": "#d62728", "gptq": "#1f77b4", "awq": "#2ca02c",
                 "int8": "#9467bd", "fp8": "#ff7f0e"}


# -- weights and their rounding error ----------------------------------------------------------------------
def linear_weights(model) -> dict[str, torch.Tensor]:
    """layer.linear -> its full-precision weight [out, in], for every decoder linear."""
    out = {}
    for name in model.quantizable_linears():
        short = name.replace("model.layers.", "").replace("self_attn.", "").replace("mlp.", "")
        out[short] = model.get_submodule(name).weight.detach().float()
    return out


def rel_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||W - W_hat|| / ||W|| (Frobenius)."""
    return float((w - w_hat).norm() / w.norm())


def weight_error_rows(weights: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool = False) -> list[dict]:
    """Per linear: its size, largest weight, spread, and RTN's relative error at these settings."""
    rows = []
    for name, w in weights.items():
        w_hat = fake_quantize(w, bits, group_size, sym)
        rows.append({"linear": name, "shape": "x".join(map(str, w.shape)), "max |w|": float(w.abs().max()),
                     "std": float(w.std()), "max |w| / std": float(w.abs().max() / w.std()),
                     "RTN rel. error": rel_error(w, w_hat)})
    return rows


def _histogram(values: torch.Tensor, bins: int, lo: float, hi: float) -> tuple[list[float], list[int]]:
    """Bin centres and counts: the figure stores these, not the values themselves."""
    counts = torch.histc(values.float().flatten(), bins, lo, hi)
    width = (hi - lo) / bins
    return [round(lo + (i + 0.5) * width, 6) for i in range(bins)], [int(c) for c in counts]


def histogram_figure(w: torch.Tensor, w_hat: torch.Tensor, title: str, bins: int = 120) -> go.Figure:
    """Left: the weights' distribution (log counts) with the values RTN rounds them to.
    Right: the rounding error's distribution."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"{title}: weights", "rounding error w_hat - w"))
    lo, hi = float(torch.minimum(w.min(), w_hat.min())), float(torch.maximum(w.max(), w_hat.max()))
    for values, name, color, n in ((w, "weights", "#1f77b4", bins), (w_hat, "after rounding", "#d62728", bins * 4)):
        x, y = _histogram(values, n, lo, hi)
        fig.add_trace(go.Bar(x=x, y=y, name=name, marker_color=color, opacity=0.6, marker_line_width=0),
                      row=1, col=1)
    err = w_hat - w
    x, y = _histogram(err, bins, float(err.min()), float(err.max()))
    fig.add_trace(go.Bar(x=x, y=y, name="error", marker_color="#ff7f0e", marker_line_width=0), row=1, col=2)
    fig.update_yaxes(type="log", title_text="count", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(barmode="overlay", bargap=0, height=360, margin=dict(l=50, r=10, t=40, b=40),
                      legend=dict(orientation="h", y=-0.2))
    return fig


def histogram_widget(weights: dict[str, torch.Tensor], name: str, bits: int = 4, group_size: int = 128) -> LessonWidget:
    """Pick a linear, a bit width and a group size; see its weights, their rounding and the error."""
    pick = widgets.Dropdown(style=LABEL_STYLE, options=list(weights), value=name, description="linear")
    bits_w = widgets.SelectionSlider(style=LABEL_STYLE, options=[2, 3, 4, 8], value=bits, description="bits", continuous_update=False)
    group_w = widgets.Dropdown(style=LABEL_STYLE, options=[("32", 32), ("64", 64), ("128", 128), ("per channel", -1)],
                               value=group_size, description="group_size")
    out = widgets.Output()

    def redraw(*_):
        w = weights[pick.value]
        g = group_w.value if group_w.value == -1 or w.shape[1] % group_w.value == 0 else -1
        w_hat = fake_quantize(w, bits_w.value, g, sym=False)
        text = (f"{pick.value}: {bits_w.value}-bit RTN, group {g if g != -1 else 'per channel'}: "
                f"relative error {rel_error(w, w_hat):.2%}, largest error {float((w_hat - w).abs().max()):.4f}")
        show_outputs(out, histogram_figure(w, w_hat, pick.value), text)

    for control in (pick, bits_w, group_w):
        control.observe(redraw, names="value")
    redraw()
    return LessonWidget("weight and rounding-error histograms", [widgets.HBox([pick, bits_w, group_w]), out])


# -- the channels AWQ protects ------------------------------------------------------------------------------
def salient_rows(x_mean: torch.Tensor, scales: torch.Tensor, top: int = 8) -> list[dict]:
    """The input channels with the largest mean |x|, and the factor AWQ gave their weights."""
    order = torch.argsort(x_mean, descending=True)[:top]
    median = float(x_mean.median())
    return [{"channel": int(c), "mean |x|": float(x_mean[c]), "times the median": float(x_mean[c]) / median,
             "AWQ scale s": float(scales[c])} for c in order]


def salient_figure(x_mean: torch.Tensor, scales: torch.Tensor, errors: dict[float, float], rtn_error: float,
                   title: str) -> go.Figure:
    """Left: mean |x| per input channel (sorted) and the scale AWQ chose for it. Right: the block's
    output error against alpha, and plain RTN's (dashed)."""
    order = torch.argsort(x_mean, descending=True)
    fig = make_subplots(rows=1, cols=2, specs=[[{"secondary_y": True}, {}]],
                        subplot_titles=(f"{title}: input channels by mean |x|", "output error vs alpha"))
    rank = list(range(len(order)))
    fig.add_trace(go.Bar(x=rank, y=[round(float(v), 5) for v in x_mean[order]], name="mean |x|",
                         marker_color="#1f77b4"), row=1, col=1)
    fig.add_trace(go.Scatter(x=rank, y=[round(float(v), 5) for v in scales[order]], name="AWQ scale s",
                             mode="lines", line=dict(color="#2ca02c")), row=1, col=1, secondary_y=True)
    alphas = sorted(errors)
    fig.add_trace(go.Scatter(x=alphas, y=[errors[a] for a in alphas], mode="lines+markers", name="output MSE",
                             line=dict(color="#d62728")), row=1, col=2)
    best = min(errors, key=errors.get)
    fig.add_vline(x=best, line_dash="dot", line_color="grey", row=1, col=2)
    fig.add_hline(y=rtn_error, line_dash="dash", line_color="#7f7f7f", annotation_text="RTN", row=1, col=2)
    fig.update_xaxes(title_text="channel rank", row=1, col=1)
    fig.update_yaxes(title_text="mean |x|", row=1, col=1, secondary_y=False)
    fig.update_yaxes(title_text="s", row=1, col=1, secondary_y=True)
    fig.update_xaxes(title_text="alpha", row=1, col=2)
    fig.update_layout(height=360, margin=dict(l=50, r=50, t=40, b=40), legend=dict(orientation="h", y=-0.2))
    return fig


def salient_widget(details: dict) -> LessonWidget:
    """Pick a layer and a linear; see its salient input channels and the scales AWQ chose.
    `details` is `QuantizeResult.details` of an AWQ run: per layer, scales, errors and mean |x|."""
    layers = sorted(details)
    names = [n for n, s in details[layers[0]]["scales"].items() if s is not None]
    layer_w = widgets.Dropdown(style=LABEL_STYLE, options=layers, value=layers[0], description="layer")
    name_w = widgets.Dropdown(style=LABEL_STYLE, options=names, value=names[0], description="linear")
    out = widgets.Output()

    def redraw(*_):
        d = details[layer_w.value]
        x_mean, s, errors = d["x_mean"][name_w.value], d["scales"][name_w.value], d["errors"][name_w.value]
        rtn_error = d["rtn_error"][name_w.value]
        best = min(errors, key=errors.get)
        text = (f"layer {layer_w.value} {name_w.value}: alpha = {best:.2f} gives {errors[best] / rtn_error:.0%} "
                f"of RTN's output error; the 8 largest input channels:\n"
                + format_table(salient_rows(x_mean, s), floatfmt=".3f"))
        show_outputs(out, salient_figure(x_mean, s, errors, rtn_error, f"layer {layer_w.value} {name_w.value}"),
                     text)

    layer_w.observe(redraw, names="value")
    name_w.observe(redraw, names="value")
    redraw()
    return LessonWidget("the channels AWQ protects", [widgets.HBox([layer_w, name_w]), out])


# -- methods side by side ------------------------------------------------------------------------------------
def methods_figure(rows: list[dict], baseline: float) -> go.Figure:
    """Perplexity increase over full precision against linear-weight memory, one point per run."""
    fig = go.Figure()
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == method]
        fig.add_trace(go.Scatter(
            x=[round(r["linear MiB"], 3) for r in pts],
            y=[round((r["perplexity"] / baseline - 1) * 100, 3) for r in pts],
            text=[r["run"] for r in pts], mode="markers+text", textposition="top center", name=method,
            marker=dict(size=11, color=METHOD_COLORS.get(method, "#8c564b"))))
    fig.update_xaxes(title_text="linear weights (MiB)", type="log")
    fig.update_yaxes(title_text="perplexity increase over fp32 (%)")
    fig.update_layout(height=420, margin=dict(l=60, r=10, t=20, b=50))
    return fig


def methods_widget(rows: list[dict], baseline: float) -> LessonWidget:
    """Pick the bit widths to compare; see perplexity against memory."""
    choices = sorted({r["bits"] for r in rows}, reverse=True)
    pick = widgets.SelectMultiple(style=LABEL_STYLE, options=choices, value=tuple(choices), description="bits", rows=len(choices))
    out = widgets.Output()

    def redraw(*_):
        shown = [r for r in rows if r["bits"] in pick.value] or rows
        show_outputs(out, methods_figure(shown, baseline),
                     format_table(shown, columns=["run", "method", "bits", "perplexity", "linear MiB"]))

    pick.observe(redraw, names="value")
    redraw()
    return LessonWidget("perplexity and memory per method and bit width", [pick, out])


# -- activation outliers: what AWQ and act-order have to work with -------------------------------------------
OUTLIER_INPUTS = {"q/k/v": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate/up": "mlp.gate_up_proj",
                  "down": "mlp.down_proj"}


@torch.no_grad()
def outlier_rows(model, windows: torch.Tensor) -> list[dict]:
    """Per decoder block: for each linear, its largest input channel's mean |x| over the median
    channel's, on the calibration windows [n, seq_len] (the ratio AWQ's scales answer to)."""
    from llmopt.quant.calibration import BlockInputs

    runner = BlockInputs(model, windows)
    rows = []
    for i, layer in enumerate(model.model.layers):
        inputs, runner.hidden = runner.capture(layer, list(OUTLIER_INPUTS.values()))
        row = {"block": i}
        for label, name in OUTLIER_INPUTS.items():
            m = inputs[name.rsplit(".", 1)[1]].abs().mean(0)
            row[label] = float(m.max() / m.median())
        rows.append(row)
    return rows


def outlier_figure(rows_by_model: dict[str, list[dict]], linear: str = "q/k/v") -> go.Figure:
    """Largest / median input channel per block, one line per model (log scale)."""
    fig = go.Figure()
    for model, rows in rows_by_model.items():
        fig.add_trace(go.Scatter(x=[r["block"] for r in rows], y=[round(r[linear], 3) for r in rows],
                                 mode="lines+markers", name=model))
    fig.update_layout(title=f"{linear} inputs: largest channel's mean |x| / the median channel's", height=380,
                      xaxis_title="decoder block", yaxis=dict(type="log", title="max / median"),
                      margin=dict(l=50, r=10, t=40, b=90), legend=LEGEND_BELOW)
    return fig
