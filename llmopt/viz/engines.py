"""Lesson 12's views: the engines compared, and the measured llmopt-vs-llama.cpp table.

The measurements come from `benchmarks/results/llamacpp.json`, which `benchmarks/llamacpp.py`
writes (it builds llama.cpp; the lesson only reads the stored numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import ipywidgets as widgets
import plotly.graph_objects as go

from llmopt.package_data import committed_result
from llmopt.viz.notebook import LessonWidget, show_outputs

ENGINES = [
    {"engine": "vLLM", "runs on": "GPUs (CUDA, ROCm, TPU)", "optimizes": "throughput of many requests",
     "signature ideas": "PagedAttention, continuous batching, prefix caching, CUDA graphs, chunked prefill"},
    {"engine": "SGLang", "runs on": "GPUs", "optimizes": "programs of many calls sharing prefixes",
     "signature ideas": "RadixAttention (prefix tree cache), compressed FSM for structured output, overlap scheduler"},
    {"engine": "TensorRT-LLM", "runs on": "NVIDIA GPUs", "optimizes": "per-GPU speed, ahead of time",
     "signature ideas": "compiled engines with fused kernels, FP8 / FP4 on Hopper and Blackwell, in-flight batching"},
    {"engine": "llama.cpp", "runs on": "CPUs (and any GPU), laptops, phones",
     "optimizes": "one user, little memory", "signature ideas":
     "GGUF block quantization (Q4_0 .. Q8_0, k-quants), hand-written SIMD dot products on quantized blocks, mmap"},
    {"engine": "MLC-LLM", "runs on": "everything via TVM: Vulkan, Metal, WebGPU, phones",
     "optimizes": "portability", "signature ideas": "ML compilation (TVM / Relax), one model compiled per target"},
]


def load_results(path: Path | None = None) -> dict:
    """benchmarks/results/llamacpp.json as shipped with llmopt, or the file at `path`."""
    return json.loads(Path(path or committed_result("llamacpp.json")).read_text())


def metric_names(results: dict) -> list[str]:
    keys = results["results"][0]["median"]
    return sorted({k.split("/")[0] for k in keys}, key=lambda m: (m != "decode", m != "prefill", m))


def result_rows(results: dict) -> list[dict]:
    """One row per (file, metric): both engines' medians and the ratio."""
    rows = []
    for r in results["results"]:
        for m in metric_names(results):
            lc, lo = r["median"][f"{m}/llama.cpp"], r["median"][f"{m}/llmopt"]
            rows.append({"file": r["model"], "metric": m, "llama.cpp tok/s": lc, "llmopt tok/s": lo,
                         "llmopt / llama.cpp": lo / lc})
    return rows


def ratio_figure(results: dict, metric: str) -> go.Figure:
    rows = [r for r in result_rows(results) if r["metric"] == metric]
    fig = go.Figure([go.Bar(name=engine, x=[r["file"] for r in rows], y=[r[f"{engine} tok/s"] for r in rows])
                     for engine in ("llama.cpp", "llmopt")])
    fig.update_layout(barmode="group", title=f"{metric}: tokens per second (median)", yaxis_title="tok/s",
                      height=360, margin=dict(t=50, b=40))
    return fig


def engines_widget(results: dict) -> LessonWidget:
    pick = widgets.Dropdown(options=metric_names(results), description="metric")
    out = widgets.Output()

    def draw(*_):
        show_outputs(out, ratio_figure(results, pick.value))

    pick.observe(draw, names="value")
    draw()
    return LessonWidget("llmopt vs llama.cpp per metric", [pick, out])
