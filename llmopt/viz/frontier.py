"""Lesson 10's views: KV bytes per token of each attention kind, measured from the engine's pool;
expert routing from the trace; self-speculation's acceptance per exit layer.

The attention "zoo" is five small random models of the same size (hidden 256, 8 query heads,
4 layers), written with transformers' own save_pretrained: MHA, GQA, MQA, a sliding window,
and DeepSeek's MLA. Their pools are what the engine allocates for them, so bytes per token
are read off the tensors, not computed from a formula (the formula is checked beside them).
"""

from __future__ import annotations

from pathlib import Path

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from llmopt.kv_bytes import KVSpec
from llmopt.viz.notebook import LessonWidget, format_table, show_outputs

SIZE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=512,
            vocab_size=4096, max_position_embeddings=1024, bos_token_id=1, eos_token_id=0,
            pad_token_id=2, initializer_range=0.1)
ZOO = {  # name -> (transformers model type, what differs)
    "MHA": ("llama", dict(num_key_value_heads=8)),
    "GQA": ("llama", dict(num_key_value_heads=2)),
    "MQA": ("llama", dict(num_key_value_heads=1)),
    "GQA + sliding window 128": ("mistral", dict(num_key_value_heads=2, sliding_window=128, head_dim=32)),
    "MLA": ("deepseek_v3", dict(num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=None,
                                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                                n_shared_experts=1, moe_intermediate_size=128, first_k_dense_replace=1,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
COLORS = {"MHA": "#d62728", "GQA": "#1f77b4", "MQA": "#2ca02c", "GQA + sliding window 128": "#17becf",
          "MLA": "#9467bd"}


def write_zoo(folder: str | Path, tokenizer_from: Path, names=None) -> dict[str, Path]:
    """The five random checkpoints (and the bundled tokenizer beside each) -> name: folder; `names`:
    only those (each written as in the whole zoo, from the same seed)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for i, (name, (model_type, extra)) in enumerate(ZOO.items()):
        if names is not None and name not in names:
            continue
        path = Path(folder) / name.split()[0].lower() / str(i)
        if not (path / "config.json").is_file():
            cfg = AutoConfig.for_model(model_type, **{**SIZE, **extra})
            torch.manual_seed(i)
            AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(Path(tokenizer_from) / f, path / f)
        out[name] = path
    return out


def pool_bytes_per_token(kv_cache) -> int:
    """Every tensor the engine's KV pool holds, over the token slots it has."""
    tensors = getattr(kv_cache, "kv", None) or (kv_cache.k + kv_cache.v)
    slots = kv_cache.num_blocks * kv_cache.block_size
    return sum(t.numel() * t.element_size() for t in tensors) // slots


def zoo_rows(llms: dict, folders: dict, context: int = 1024) -> list[dict]:
    """Per model: pool bytes per token (measured), lesson 01's formula, and what one sequence of
    `context` tokens needs, in a pool that frees blocks behind a sliding window and in this one."""
    rows = []
    for name, llm in llms.items():
        engine = llm.llm_engine
        spec = KVSpec.from_pretrained(folders[name])
        measured = pool_bytes_per_token(engine.kv_cache)
        window = next((w for w in engine.model_config.sliding_windows if w), None)
        rows.append({"attention": name, "bytes/token (pool)": measured,
                     "bytes/token (formula)": spec.bytes_per_token(engine.kv_cache.cache_dtype.itemsize),
                     "vs MHA": None, f"KB for {context} tokens, window-aware pool":
                     measured * min(context, window or context) / 1e3,
                     f"KB for {context} tokens, llmopt's pool": measured * context / 1e3})
    mha = rows[0]["bytes/token (pool)"]
    for r in rows:
        r["vs MHA"] = r["bytes/token (pool)"] / mha
    return rows


def tokens_in_budget(rows: list[dict], budget_bytes: float) -> list[dict]:
    return [{"attention": r["attention"], "bytes/token": r["bytes/token (pool)"],
             "tokens that fit": int(budget_bytes // r["bytes/token (pool)"])} for r in rows]


def budget_figure(rows: list[dict], budget_bytes: float) -> go.Figure:
    fit = tokens_in_budget(rows, budget_bytes)
    fig = go.Figure(go.Bar(x=[r["attention"] for r in fit], y=[r["tokens that fit"] for r in fit],
                           marker_color=[COLORS.get(r["attention"], "#7f7f7f") for r in fit],
                           text=[f"{r['bytes/token']:,} B/token" for r in fit], textposition="outside"))
    fig.update_layout(title=f"tokens of KV that fit in {budget_bytes / 2**20:g} MiB (measured bytes per token)",
                      yaxis_title="tokens", height=360, margin=dict(l=50, r=10, t=40, b=80))
    return fig


def budget_widget(rows: list[dict], budget_mib: int = 16) -> LessonWidget:
    """A budget slider: how many tokens of each attention kind's KV fit in it."""
    slider = widgets.IntSlider(value=budget_mib, min=1, max=256, description="budget MiB")
    out = widgets.Output()

    def redraw(*_):
        budget = slider.value * 2**20
        show_outputs(out, format_table(tokens_in_budget(rows, budget)), budget_figure(rows, budget))

    slider.observe(redraw, "value")
    redraw()
    return LessonWidget("KV tokens in a memory budget", [slider, out])


def routing_figure(expert_ids: list[list[int]], labels: list[str], num_experts: int, layer: int) -> go.Figure:
    """Token x expert: which experts each token of one step went to in one MoE layer."""
    grid = [[1 if e in ids else 0 for e in range(num_experts)] for ids in expert_ids]
    fig = go.Figure(go.Heatmap(z=grid, x=[f"expert {e}" for e in range(num_experts)], y=labels,
                               colorscale=[[0, "#f7f7f7"], [1, "#9467bd"]], showscale=False))
    fig.update_layout(title=f"layer {layer}: the experts each token was routed to (top-k)",
                      height=80 + 18 * len(labels), margin=dict(l=120, r=10, t=40, b=40),
                      yaxis_autorange="reversed")
    return fig


def acceptance_figure(rows: list[dict], title: str) -> go.Figure:
    fig = go.Figure()
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        fig.add_trace(go.Scatter(x=[r["exit layer"] for r in mine], y=[r["acceptance rate"] for r in mine],
                                 mode="lines+markers", name=model))
    fig.update_layout(title=title, xaxis_title="exit layer (draft = the first E layers + the model's head)",
                      yaxis_title="acceptance rate", yaxis_range=[0, 1], height=340)
    return fig
