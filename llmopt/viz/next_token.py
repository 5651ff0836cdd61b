"""The next-token explorer: what the model predicts after a prompt, and what sampling keeps of it.

One forward pass gives a score (logit) for every token of the vocabulary; softmax turns the
scores into probabilities. Temperature sharpens or flattens them and top-p cuts the tail,
with the engine's own `filter_logits`; generating is picking one token and doing it again.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from llmopt.layers.attention import AttentionMetadata
from llmopt.layers.sampler import filter_logits, sample
from llmopt.model.forward import run_model
from llmopt.sampling_params import SamplingParams
from llmopt.viz.notebook import LABEL_STYLE, LEGEND_BELOW, LessonWidget, format_table, show_outputs
from llmopt.worker.kv_cache import NoKVCache


@torch.inference_mode()
def next_token_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [vocab] for the token after `token_ids` (one full forward, no cache)."""
    device = next(model.parameters()).device
    hidden = run_model(model, NoKVCache(), torch.tensor(token_ids, device=device),
                       AttentionMetadata.uncached([len(token_ids)], device))
    return model.compute_logits(hidden[-1:])[0]


def exact_next_token_probs(model, token_ids: list[int]) -> torch.Tensor:
    """The next-token distribution [vocab], float64, computed by a float64 copy of `model`.

    For experiments that draw thousands of samples against it and print the counts: float32's
    last bits differ between CPUs (vector widths, fused multiply-add), and a difference of 1e-6
    in a probability is enough to move one draw of 20,000 across a boundary. In float64 the
    counts are the same on every machine."""
    import copy

    exact = copy.deepcopy(model).double()
    return next_token_logits(exact, token_ids).double().softmax(-1)


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution the sampler draws from; temperature 0 is greedy (all mass on the argmax)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
    filtered = filter_logits(logits[None], torch.tensor([float(temperature)]), torch.tensor([-1]),
                             torch.tensor([float(top_p)]), torch.tensor([0.0]))
    return filtered.softmax(-1)[0]


def next_token_rows(llm, token_ids: list[int], temperature: float = 1.0, top_p: float = 1.0,
                    top_n: int = 10) -> list[dict]:
    """The `top_n` most likely next tokens: raw probability and after temperature / top-p."""
    logits = next_token_logits(llm.model, token_ids)
    raw = logits.softmax(-1)
    kept = filtered_probs(logits, temperature, top_p)
    top = raw.topk(top_n)
    return [{"rank": r + 1, "token_id": int(i), "token": repr(llm.tokenizer.decode([int(i)])),
             "logit": round(float(logits[i]), 3), "p (model)": round(float(p), 4),
             "p (sampled from)": round(float(kept[i]), 4)}
            for r, (p, i) in enumerate(zip(top.values, top.indices))]


def next_token_table(rows: list[dict]) -> str:
    return format_table(rows, floatfmt=".4f")


def next_token_figure(rows: list[dict], title: str = "") -> go.Figure:
    labels = [f"{r['token']} ({r['token_id']})" for r in rows]
    fig = go.Figure([
        go.Bar(name="model (temperature 1)", x=labels, y=[r["p (model)"] for r in rows]),
        go.Bar(name="sampled from (your settings)", x=labels, y=[r["p (sampled from)"] for r in rows]),
    ])
    fig.update_layout(title=title, barmode="group", height=400, margin=dict(l=40, r=10, t=40, b=110),
                      yaxis_title="probability", yaxis_range=[0, 1], legend=LEGEND_BELOW)
    return fig


def next_token_widget(llm, prompt: str = "def ", temperature: float = 1.0, top_p: float = 1.0,
                      top_n: int = 10, seed: int = 0) -> LessonWidget:
    """Type a prompt, turn temperature and top-p, and grow the text one token at a time."""
    prompt_box = widgets.Text(style=LABEL_STYLE, value=prompt, description="prompt", layout=widgets.Layout(width="60%"))
    temp = widgets.FloatSlider(style=LABEL_STYLE, value=temperature, min=0.0, max=2.0, step=0.1, description="temperature")
    top_p_slider = widgets.FloatSlider(style=LABEL_STYLE, value=top_p, min=0.05, max=1.0, step=0.05, description="top_p")
    bars = widgets.IntSlider(style=LABEL_STYLE, value=top_n, min=3, max=25, description="tokens shown")
    greedy_btn = widgets.Button(description="append top token")
    sample_btn = widgets.Button(description="sample a token")
    reset_btn = widgets.Button(description="reset")
    text_view = widgets.HTML()
    out = widgets.Output()
    state = {"ids": llm.tokenizer(prompt)["input_ids"]}
    generator = torch.Generator().manual_seed(seed)  # the same clicks draw the same tokens

    def redraw(*_):
        text = llm.tokenizer.decode(state["ids"], skip_special_tokens=True)
        text_view.value = f"<pre>{_escape(text)}</pre><small>{len(state['ids'])} tokens</small>"
        rows = next_token_rows(llm, state["ids"], temp.value, top_p_slider.value, bars.value)
        show_outputs(out, next_token_figure(rows, "next token after the text above"),
                     next_token_table(rows))

    def append(token_id: int):
        state["ids"] = state["ids"] + [token_id]
        redraw()

    def on_greedy(_):
        append(int(next_token_logits(llm.model, state["ids"]).argmax()))

    def on_sample(_):
        logits = next_token_logits(llm.model, state["ids"])[None]
        params = SamplingParams(temperature=temp.value, top_p=top_p_slider.value)
        append(int(sample(logits, [params], [generator])[0]))

    def on_reset(*_):
        state["ids"] = llm.tokenizer(prompt_box.value or " ")["input_ids"]
        redraw()

    greedy_btn.on_click(on_greedy)
    sample_btn.on_click(on_sample)
    reset_btn.on_click(on_reset)
    prompt_box.observe(on_reset, names="value")
    for w in (temp, top_p_slider, bars):
        w.observe(redraw, names="value")
    redraw()
    return LessonWidget("next-token explorer", [
        widgets.HBox([prompt_box, reset_btn]),
        widgets.HBox([temp, top_p_slider, bars]),
        widgets.HBox([greedy_btn, sample_btn]),
        text_view, out])


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
