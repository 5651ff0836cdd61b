"""Views for lesson 07 (FP8): the e4m3 and e5m2 value grids, a value picker that shows a
number's representable neighbours, the error a per-tensor scale gives on real keys and
values, and which GPUs run FP8 natively.

Numbers come from `llmopt.fp8.format` (the same casts the engine's FP8 cache and weights use);
every figure and widget has a text form built from the same rows.
"""

from __future__ import annotations

import math

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from llmopt.fp8.format import E4M3, E5M2, dequantize_fp8, fp8_neighbours, fp8_values, quantize_fp8
from llmopt.layers.attention import AttentionMetadata
from llmopt.model.forward import run_model
from llmopt.viz.notebook import LABEL_STYLE, LessonWidget, format_table, show_outputs
from llmopt.worker.kv_cache import NoKVCache

FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
COLORS = {"e4m3": "#1f77b4", "e5m2": "#d62728", "float16": "#7f7f7f", "bfloat16": "#2ca02c"}


# ---- the formats ---------------------------------------------------------------------------------

def format_rows() -> list[dict]:
    """The constants of both FP8 formats, beside float16 and bfloat16."""
    rows = []
    for name, dtype, e, m in (("e4m3", torch.float8_e4m3fn, 4, 3), ("e5m2", torch.float8_e5m2, 5, 2),
                              ("float16", torch.float16, 5, 10), ("bfloat16", torch.bfloat16, 8, 7)):
        fi = torch.finfo(dtype)
        tiny = fi.smallest_normal * 2.0 ** -m  # smallest subnormal
        rows.append({"format": name, "bits": 1 + e + m, "exponent bits": e, "mantissa bits": m,
                     "largest": f"{fi.max:g}", "smallest normal": f"{fi.smallest_normal:.3g}",
                     "smallest subnormal": f"{tiny:.3g}",
                     "range (binades)": round(math.log2(fi.max / tiny), 1),
                     "relative step": f"2^-{m} = {2.0 ** -m:.3g}"})
    return rows


def _positive_grid(name: str) -> torch.Tensor:
    if name in FORMATS:
        g = fp8_values(FORMATS[name].dtype)
        return g[g > 0].double()
    # 16-bit formats: every positive finite bit pattern, 32768 of them less the non-finite ones
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]
    v = torch.arange(1, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).double()
    return v[torch.isfinite(v)]


def spacing_figure(names=("e4m3", "e5m2", "float16", "bfloat16"), points: int = 400) -> go.Figure:
    """Gap to the next representable value, against the value, on log-log axes: a staircase
    that is flat in the subnormals (a fixed absolute step) and climbs by 2x per binade after
    (a fixed relative step). Where a line ends is the format's largest value."""
    fig = go.Figure()
    for name in names:
        g = _positive_grid(name)
        gaps = g[1:] - g[:-1]
        idx = torch.linspace(0, len(gaps) - 1, min(points, len(gaps))).round().long().unique()
        fig.add_scatter(x=g[:-1][idx].tolist(), y=gaps[idx].tolist(), mode="lines", name=name,
                        line=dict(shape="hv", color=COLORS[name], width=3 if name in FORMATS else 1.5))
    fig.update_layout(title="Distance to the next representable value", xaxis_type="log", yaxis_type="log",
                      xaxis_title="value", yaxis_title="step to the next value", height=380,
                      margin=dict(l=60, r=10, t=40, b=50))
    return fig


def grid_figure(lo: float = 0.0, hi: float = 16.0) -> go.Figure:
    """Every e4m3 and e5m2 value in [lo, hi], as ticks on two number lines."""
    fig = go.Figure()
    for row, name in enumerate(FORMATS):
        g = fp8_values(FORMATS[name].dtype)
        g = g[(g >= lo) & (g <= hi)].tolist()
        fig.add_scatter(x=g, y=[row] * len(g), mode="markers", name=f"{name} ({len(g)} values)",
                        marker=dict(symbol="line-ns-open", size=18, color=COLORS[name]))
    fig.update_layout(title=f"The FP8 values between {lo:g} and {hi:g}", height=220,
                      yaxis=dict(tickvals=[0, 1], ticktext=list(FORMATS), range=[-0.7, 1.7]),
                      xaxis_title="value", margin=dict(l=60, r=10, t=40, b=40))
    return fig


# ---- one value: its neighbours and its error --------------------------------------------------------

def encoding(x: float, name: str) -> str:
    """The bits the cast stores for x (after clamping), as sign | exponent | mantissa."""
    fmt = FORMATS[name]
    b = int(quantize_fp8(torch.tensor([x]), 1.0, fmt.dtype).view(torch.uint8)[0])
    bits = f"{b:08b}"
    return f"{bits[0]} {bits[1:1 + fmt.exponent_bits]} {bits[1 + fmt.exponent_bits:]}"


def neighbour_rows(values: list[float], names=("e4m3", "e5m2")) -> list[dict]:
    rows = []
    for x in values:
        for name in names:
            n = fp8_neighbours(x, FORMATS[name].dtype)
            rows.append({"x": x, "format": name, "below": n["below"], "above": n["above"],
                         "stored": n["rounded"], "bits": encoding(x, name), "error": n["error"],
                         "relative error": f"{100 * n['relative_error']:.2f}%"})
    return rows


def neighbour_figure(x: float, name: str = "e4m3", around: int = 6) -> go.Figure:
    """The grid near x: `around` representable values on each side, x, and where it lands."""
    fmt = FORMATS[name]
    grid = fp8_values(fmt.dtype)
    n = fp8_neighbours(x, fmt.dtype)
    i = int(torch.searchsorted(grid, torch.tensor(n["rounded"])))
    near = grid[max(0, i - around):i + around + 1].tolist()
    fig = go.Figure()
    fig.add_scatter(x=near, y=[0] * len(near), mode="markers", name=f"{name} values",
                    marker=dict(symbol="line-ns-open", size=24, color=COLORS[name]))
    fig.add_scatter(x=[x], y=[0.35], mode="markers+text", name="x", text=[f"x = {x:g}"],
                    textposition="top center", marker=dict(symbol="triangle-down", size=12, color="black"))
    fig.add_scatter(x=[n["rounded"]], y=[0], mode="markers", name=f"stored: {n['rounded']:g}",
                    marker=dict(size=12, color="orange"))
    fig.update_layout(title=f"{name} values around {x:g}: stored as {n['rounded']:g} "
                            f"(error {n['error']:+.4g})", height=240, yaxis=dict(visible=False, range=[-0.5, 1.0]),
                      xaxis_title="value", margin=dict(l=20, r=10, t=40, b=40))
    return fig


def neighbour_text(x: float, name: str) -> str:
    n = fp8_neighbours(x, FORMATS[name].dtype)
    fmt = FORMATS[name]
    clamp = f" (beyond +-{fmt.max:g}: clamped first)" if abs(x) > fmt.max else ""
    return (f"x = {x:g} in {name}{clamp}\n"
            f"  neighbours      {n['below']:g} and {n['above']:g}   (step {n['above'] - n['below']:g})\n"
            f"  stored          {n['rounded']:g}   bits {encoding(x, name)}   (sign | exponent | mantissa)\n"
            f"  error           {n['error']:+.6g}   ({100 * n['relative_error']:.3f}% of x)")


def fp8_value_widget(value: float = 300.0, name: str = "e4m3") -> LessonWidget:
    """Type a number, pick a format: its representable neighbours, the value stored, the error."""
    box = widgets.FloatText(style=LABEL_STYLE, value=value, description="x", step=0.1)
    pick = widgets.ToggleButtons(style=LABEL_STYLE, options=list(FORMATS), value=name, description="format")
    out = widgets.Output()

    def redraw(*_):
        show_outputs(out, neighbour_text(box.value, pick.value), neighbour_figure(box.value, pick.value))

    box.observe(redraw, names="value")
    pick.observe(redraw, names="value")
    redraw()
    return LessonWidget("FP8 value picker", [widgets.HBox([box, pick]), out])


# ---- a scale on real keys and values -------------------------------------------------------------------

class _KVRecorder(NoKVCache):
    """Keeps one layer's keys and values (after RoPE), and nothing else, as NoKVCache."""

    def __init__(self, layer: int):
        self.layer, self.k, self.v = layer, None, None

    def store(self, layer, k, v, meta):
        if layer == self.layer:
            self.k, self.v = k.detach().clone(), v.detach().clone()


@torch.inference_mode()
def capture_kv(model, token_ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values one layer writes to its cache for a sequence: [tokens, kv heads, head dim]."""
    device = next(model.parameters()).device
    rec = _KVRecorder(layer)
    run_model(model, rec, torch.tensor(token_ids, device=device), AttentionMetadata.uncached([len(token_ids)], device))
    return rec.k.float().cpu(), rec.v.float().cpu()


def scale_error(x: torch.Tensor, scale: float, name: str) -> dict:
    """What a per-tensor scale does to x: relative RMS error of the round trip, and the share of
    values clamped at the top, stored as subnormals, or flushed to zero."""
    fmt = FORMATS[name]
    q = quantize_fp8(x, scale, fmt.dtype)
    back = dequantize_fp8(q, scale)
    y = (x / scale).abs()
    nonzero = x != 0
    return {"scale": scale, "format": name,
            "relative RMS error": ((back - x).norm() / x.norm()).item(),
            "clamped": (y > fmt.max).float().mean().item(),
            "subnormal": ((y < fmt.min_normal) & (q.float() != 0)).float().mean().item(),
            "flushed to zero": ((q.float() == 0) & nonzero).float().mean().item()}


def scale_sweep_rows(x: torch.Tensor, names=("e4m3", "e5m2"), decades: tuple[int, int] = (-9, 4),
                     per_decade: int = 6) -> list[dict]:
    """scale_error over scales spaced evenly on a log axis."""
    lo, hi = decades
    scales = [10 ** (lo + i / per_decade) for i in range((hi - lo) * per_decade + 1)]
    return [scale_error(x, s, n) for n in names for s in scales]


def scale_sweep_figure(rows: list[dict], marks: dict[str, float], title: str = "") -> go.Figure:
    """Round-trip error against the scale (log-log), with chosen scales marked."""
    fig = go.Figure()
    for name in dict.fromkeys(r["format"] for r in rows):
        rs = [r for r in rows if r["format"] == name]
        fig.add_scatter(x=[r["scale"] for r in rs], y=[r["relative RMS error"] for r in rs], mode="lines",
                        name=name, line=dict(color=COLORS[name], width=2.5))
    for label, s in marks.items():
        fig.add_vline(x=s, line_dash="dot", annotation_text=label, annotation_position="top")
    fig.update_layout(title=title or "Round-trip error of a per-tensor scale", xaxis_type="log", yaxis_type="log",
                      xaxis_title="scale (values stored as x / scale)", yaxis_title="relative RMS error",
                      height=380, margin=dict(l=60, r=10, t=50, b=50))
    return fig


def scale_widget(x: torch.Tensor, what: str = "keys", scale: float = 1.0) -> LessonWidget:
    """Slide the scale: where |x| / scale falls on the format's range, and the error it costs."""
    slider = widgets.FloatLogSlider(style=LABEL_STYLE, value=scale, base=10, min=-9, max=4, step=0.05, description="scale",
                                    readout_format=".2e", layout=widgets.Layout(width="480px"))
    pick = widgets.ToggleButtons(style=LABEL_STYLE, options=list(FORMATS), value="e4m3", description="format")
    out = widgets.Output()
    mags = x.abs().flatten()
    mags = mags[mags > 0]

    def redraw(*_):
        fmt, s = FORMATS[pick.value], slider.value
        r = scale_error(x, s, pick.value)
        text = (f"{what}: amax {mags.max().item():.4g}; with scale {s:.3g} the largest stored value is "
                f"{min(mags.max().item() / s, fmt.max):.4g} (format max {fmt.max:g})\n"
                f"  relative RMS error {r['relative RMS error']:.3%}; clamped {r['clamped']:.2%}, "
                f"subnormal {r['subnormal']:.2%}, flushed to zero {r['flushed to zero']:.2%}")
        fig = go.Figure()
        fig.add_histogram(x=torch.log2(mags / s).tolist(), nbinsx=80, name="|x| / scale",
                          marker_color=COLORS[pick.value])
        for label, v in (("smallest subnormal", fmt.min_subnormal), ("smallest normal", fmt.min_normal),
                         ("largest", fmt.max)):
            fig.add_vline(x=math.log2(v), line_dash="dot", annotation_text=label)
        fig.update_layout(title=f"Where the stored values fall ({pick.value})", xaxis_title="log2(|x| / scale)",
                          yaxis_title="count", height=300, margin=dict(l=50, r=10, t=40, b=40), showlegend=False)
        show_outputs(out, text, fig)

    slider.observe(redraw, names="value")
    pick.observe(redraw, names="value")
    redraw()
    return LessonWidget(f"FP8 scale for the {what}", [widgets.HBox([slider, pick]), out])


# ---- where FP8 runs natively ---------------------------------------------------------------------------

NATIVE_ROWS = [
    # architecture, compute capability, examples, FP8 tensor cores, what llmopt does there
    {"architecture": "Volta / Turing", "compute capability": "7.0 / 7.5", "GPUs": "V100, T4, RTX 20",
     "FP8 matmul (tensor cores)": "no", "Triton e4m3 type": "no",
     "llmopt FP8 KV cache": "stored fp8; kernels decode e4m3 bytes, e5m2 natively",
     "llmopt FP8 weights": "stored fp8, weight-only (widened in the matmul)"},
    {"architecture": "Ampere", "compute capability": "8.0 / 8.6 / 8.7", "GPUs": "A100, A10, A40, RTX 30",
     "FP8 matmul (tensor cores)": "no", "Triton e4m3 type": "no",
     "llmopt FP8 KV cache": "stored fp8; kernels decode e4m3 bytes, e5m2 natively",
     "llmopt FP8 weights": "stored fp8, weight-only (widened in the matmul)"},
    {"architecture": "Ada Lovelace", "compute capability": "8.9", "GPUs": "L4, L40S, RTX 4090",
     "FP8 matmul (tensor cores)": "yes (e4m3, e5m2)", "Triton e4m3 type": "yes",
     "llmopt FP8 KV cache": "stored fp8, native loads", "llmopt FP8 weights": "torch._scaled_mm"},
    {"architecture": "Hopper", "compute capability": "9.0", "GPUs": "H100, H200, GH200",
     "FP8 matmul (tensor cores)": "yes (e4m3, e5m2)", "Triton e4m3 type": "yes",
     "llmopt FP8 KV cache": "stored fp8, native loads", "llmopt FP8 weights": "torch._scaled_mm"},
    {"architecture": "Blackwell", "compute capability": "10.0 / 12.0", "GPUs": "B200, GB200, RTX 50",
     "FP8 matmul (tensor cores)": "yes (also FP6/FP4, MX block scales)", "Triton e4m3 type": "yes",
     "llmopt FP8 KV cache": "stored fp8, native loads", "llmopt FP8 weights": "torch._scaled_mm"},
    {"architecture": "CPU", "compute capability": "-", "GPUs": "-",
     "FP8 matmul (tensor cores)": "no", "Triton e4m3 type": "interpreter",
     "llmopt FP8 KV cache": "stored fp8, widened to fp32 to attend",
     "llmopt FP8 weights": "stored fp8, weight-only (widened in the matmul)"},
]


def native_table() -> str:
    return format_table(NATIVE_ROWS)


def this_machine() -> str:
    """What this machine can do with FP8, in one line."""
    from llmopt.fp8.format import native_fp8_supported

    if not torch.cuda.is_available():
        return "this machine: CPU only: FP8 is a storage format here; the math is emulated exactly in fp32"
    cc = torch.cuda.get_device_capability()
    native = native_fp8_supported("cuda")
    return (f"this machine: {torch.cuda.get_device_name()}, compute capability {cc[0]}.{cc[1]}: "
            f"{'FP8 tensor cores' if native else 'no FP8 tensor cores (storage only)'}")
