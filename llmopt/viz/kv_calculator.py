"""The KV memory calculator: sliders for a model's KV shape, batch and length, numbers from llmopt.kv_bytes.

Pick a real model's preset or move the sliders; the readout gives bytes per token, per
sequence and for the whole batch, and the chart puts every preset side by side at the same
batch, length and dtype, so MHA, GQA, MQA and MLA can be compared at a glance.
"""

from __future__ import annotations

from dataclasses import replace

import ipywidgets as widgets
import plotly.graph_objects as go

from llmopt.kv_bytes import DTYPE_BYTES, PRESETS, KVSpec, format_bytes
from llmopt.viz.notebook import LABEL_STYLE, LessonWidget, format_table, show_outputs

REFERENCE_BYTES = 40e9  # the "over 40 GB of KV" claim lesson 01 checks
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def kv_rows(specs: list[KVSpec], num_tokens: int, batch_size: int = 1, dtype_bytes: int = 2,
            budget_bytes: float = REFERENCE_BYTES) -> list[dict]:
    """One row per model: its KV shape, bytes per token, the batch's KV, and what fits in the budget."""
    rows = []
    for s in specs:
        mla = s.attention == "MLA"
        rows.append({
            "model": s.name, "attention": s.attention, "layers": s.num_layers,
            "KV heads": None if mla else s.num_kv_heads,
            "head dim": None if mla else s.head_dim,
            "MLA latent": s.kv_lora_rank + (s.qk_rope_head_dim or 0) if mla else None,
            "bytes/token": s.bytes_per_token(dtype_bytes),
            "KV total": format_bytes(s.cache_bytes(num_tokens, batch_size, dtype_bytes)),
            f"seqs in {budget_bytes / 1e9:g} GB": s.max_concurrency(budget_bytes, num_tokens, dtype_bytes),
        })
    return rows


def kv_table(specs: list[KVSpec], num_tokens: int, batch_size: int = 1, dtype_bytes: int = 2,
             budget_bytes: float = REFERENCE_BYTES) -> str:
    head = f"KV cache of {batch_size:,} x {num_tokens:,} tokens, {dtype_bytes} bytes per number\n"
    return head + format_table(kv_rows(specs, num_tokens, batch_size, dtype_bytes, budget_bytes))


def kv_figure(specs: list[KVSpec], num_tokens: int, batch_size: int = 1, dtype_bytes: int = 2,
              highlight: str | None = None) -> go.Figure:
    """Bars of KV memory (GB) per model at one batch, length and dtype, with the 40 GB line."""
    gb = [round(s.cache_bytes(num_tokens, batch_size, dtype_bytes) / 1e9, 4) for s in specs]
    colors = {"MHA": "#d62728", "GQA": "#1f77b4", "MQA": "#2ca02c", "MLA": "#9467bd"}
    fig = go.Figure(go.Bar(
        x=[s.name for s in specs], y=gb,
        marker_color=[colors[s.attention] for s in specs],
        marker_line_width=[3 if s.name == highlight else 0 for s in specs],
        marker_line_color="black",
        text=[s.attention for s in specs], textposition="outside"))
    fig.add_hline(y=REFERENCE_BYTES / 1e9, line_dash="dash", annotation_text="40 GB")
    fig.update_layout(
        title=f"KV cache: {batch_size:,} x {num_tokens:,} tokens, {dtype_bytes} B per number",
        yaxis_title="GB", height=360, margin=dict(l=50, r=10, t=40, b=80))
    return fig


def percent(share: float) -> str:
    """A share as a percentage with two significant digits below 10% ("0.022%", not "0.0%")."""
    p = 100 * share
    return f"{p:,.0f}%" if p >= 10 else f"{p:.2g}%"


def kv_readout(spec: KVSpec, num_tokens: int, batch_size: int, dtype_bytes: int) -> str:
    per_token = spec.bytes_per_token(dtype_bytes)
    per_seq = spec.cache_bytes(num_tokens, 1, dtype_bytes)
    total = spec.cache_bytes(num_tokens, batch_size, dtype_bytes)
    if spec.attention == "MLA":
        shape = (f"{spec.num_layers} layers x ({spec.kv_lora_rank} latent + {spec.qk_rope_head_dim} rope) "
                 f"x {dtype_bytes} B")
    else:
        shape = f"{spec.num_layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim} x 2 (K, V) x {dtype_bytes} B"
    lines = [
        f"{spec.name} ({spec.attention})",
        f"  bytes per token   {per_token:>16,}   = {shape}",
        f"  one sequence      {per_seq:>16,}   = {format_bytes(per_seq)} at {num_tokens:,} tokens",
        f"  whole batch       {total:>16,}   = {format_bytes(total)} for a batch of {batch_size:,}",
        f"  over 40 GB?       {'yes' if total > REFERENCE_BYTES else 'no':>16}   "
        f"({spec.max_concurrency(REFERENCE_BYTES, num_tokens, dtype_bytes):,} such sequences fit in 40 GB)",
    ]
    if spec.num_params:
        weights = spec.num_params * 2
        lines.append(f"  for scale: the weights in bfloat16 take {format_bytes(weights)}; "
                     f"this batch's KV is {percent(total / weights)} of that")
    if spec.max_position_embeddings and num_tokens > spec.max_position_embeddings:
        lines.append(f"  note: {num_tokens:,} tokens is longer than this model's context "
                     f"({spec.max_position_embeddings:,} positions)")
    return "\n".join(lines)


def kv_calculator_widget(presets: dict[str, KVSpec] | None = None, preset: str = "Llama-2-70B",
                         num_tokens: int = 4096, batch_size: int = 1, dtype: str = "bfloat16") -> LessonWidget:
    presets = presets or PRESETS
    style = LABEL_STYLE
    pick = widgets.Dropdown(options=list(presets), value=preset, description="preset", style=style)
    layers = widgets.IntSlider(min=1, max=160, description="layers", style=style)
    kv_heads = widgets.IntSlider(min=1, max=128, description="KV heads", style=style)
    head_dim = widgets.IntSlider(min=16, max=256, step=16, description="head dim", style=style)
    lora = widgets.IntSlider(min=64, max=2048, step=64, description="kv_lora_rank", style=style)
    rope = widgets.IntSlider(min=0, max=128, step=16, description="qk_rope_head_dim", style=style)
    dtype_pick = widgets.Dropdown(options=[(f"{k} ({v} B)", v) for k, v in DTYPE_BYTES.items()],
                                  value=DTYPE_BYTES[dtype], description="KV dtype", style=style)
    batch = widgets.IntSlider(value=batch_size, min=1, max=256, description="batch", style=style)
    length = widgets.SelectionSlider(options=[(f"{n:,}", n) for n in LENGTHS], value=num_tokens,
                                     description="tokens/seq", style=style)
    out = widgets.Output()
    mha_box, mla_box = widgets.VBox([kv_heads, head_dim]), widgets.VBox([lora, rope])
    loading = {"on": False}

    def current() -> KVSpec:
        base = presets[pick.value]
        if base.attention == "MLA":
            spec = replace(base, num_layers=layers.value, kv_lora_rank=lora.value,
                           qk_rope_head_dim=rope.value)
        else:
            spec = replace(base, num_layers=layers.value, num_kv_heads=kv_heads.value,
                           head_dim=head_dim.value)
        if spec != base:  # moved a slider: no longer the real model
            # more KV heads than query heads makes no model; count it as MHA
            spec = replace(spec, name=f"{base.name} (edited)", num_params=None,
                           num_attention_heads=max(spec.num_kv_heads, base.num_attention_heads))
        return spec

    def redraw(*_):
        if loading["on"]:
            return
        spec = current()
        specs = list(presets.values())
        if spec.name not in presets:
            specs.append(spec)
        show_outputs(out, kv_readout(spec, length.value, batch.value, dtype_pick.value),
                     kv_figure(specs, length.value, batch.value, dtype_pick.value, highlight=spec.name))

    def load_preset(*_):
        s = presets[pick.value]
        loading["on"] = True  # set all sliders, then draw once
        layers.value = s.num_layers
        if s.attention == "MLA":
            lora.value, rope.value = s.kv_lora_rank, s.qk_rope_head_dim or 0
        else:
            kv_heads.value, head_dim.value = s.num_kv_heads, s.head_dim
        mha_box.layout.display = "none" if s.attention == "MLA" else None
        mla_box.layout.display = None if s.attention == "MLA" else "none"
        loading["on"] = False
        redraw()

    pick.observe(load_preset, names="value")
    for w in (layers, kv_heads, head_dim, lora, rope, dtype_pick, batch, length):
        w.observe(redraw, names="value")
    load_preset()
    return LessonWidget("KV memory calculator", [
        widgets.HBox([widgets.VBox([pick, layers, mha_box, mla_box]),
                      widgets.VBox([dtype_pick, batch, length])]),
        out])
