"""Speculative decoding, seen from the engine's trace: which guesses the target kept, and why
the output is still the target's.

Each verification step in the trace holds the proposer's drafts and what the target emitted:
the accepted prefix of the drafts, then one token of its own (a *replacement* for the first
rejected draft, or a *bonus* token when every draft was accepted). `token_sources` turns that
into a labelled token stream, drawn coloured as HTML and as a per-step table. The other views
count acceptance per draft position, sweep k and temperature, check by sampling that the
rejection sampler reproduces the target's distribution, and set measured speedups beside
Leviathan et al.'s formula.
"""

from __future__ import annotations

import html
import itertools
from dataclasses import dataclass, field

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmopt.bench.spec import expected_tokens_per_step, predicted_speedup
from llmopt.sampling_params import SamplingParams
from llmopt.viz.notebook import LABEL_STYLE, LEGEND_BELOW, LessonWidget, format_table, show_outputs

# target: a token the target made alone (after a prefill, or a decode step with no drafts)
KINDS = ("target", "accepted", "rejected", "replacement", "bonus")
KIND_COLORS = {"target": "#e6e6e6", "accepted": "#b7e1b0", "rejected": "#f7b0a8",
               "replacement": "#fdd49e", "bonus": "#a6cbe8"}
METHOD_COLORS = {"ngram": "#9467bd", "draft_model": "#1f77b4", "eagle": "#2ca02c"}


# -- the token stream of one request -------------------------------------------------------------
def token_sources(trace: list[dict], output) -> list[dict]:
    """Every token the request's verification steps produced or threw away, in order.

    `output` is the request's finished RequestOutput. One row per token: the engine step, the
    output position it holds (rejected drafts: the position they were guessed for), the
    token id, its kind (KINDS) and its index in the proposal (None for the target's own).
    Tokens the engine emitted past a stop (EOS, max_tokens) are left out, as the engine does.
    """
    if not hasattr(output, "outputs") or not hasattr(output, "prompt_token_ids"):
        raise TypeError(f"output must be a RequestOutput from LLM.generate, got {type(output).__name__}")
    rid, produced = output.request_id, list(output.outputs[0].token_ids)
    prompt_len = len(output.prompt_token_ids)
    rows: list[dict] = []
    n = 0  # output tokens accounted for so far
    seen = False

    def add(step, token, kind, index=None):
        nonlocal n
        if kind != "rejected":
            if n >= len(produced):
                return
            if produced[n] != token:
                raise ValueError(f"trace and output of {rid} disagree at output token {n}: "
                                 f"{token} in the trace, {produced[n]} in the output")
        rows.append({"step": step, "position": n, "token_id": int(token), "kind": kind,
                     "draft_index": index})
        n += kind != "rejected"

    for i, entry in enumerate(trace):
        for s in entry["scheduled"]:
            if s["request_id"] != rid:
                continue
            seen = True
            if "emitted_token_ids" in s:
                drafts, emitted = s["draft_token_ids"], s["emitted_token_ids"]
                accepted = len(emitted) - 1
                for j in range(accepted):
                    add(i, drafts[j], "accepted", j)
                start = n
                for j in range(accepted, len(drafts)):  # shown at the positions they were meant for
                    rows.append({"step": i, "position": start + j - accepted, "token_id": int(drafts[j]),
                                 "kind": "rejected", "draft_index": j})
                add(i, emitted[-1], "bonus" if accepted == len(drafts) else "replacement")
            elif s["context_len"] + s["num_tokens"] == prompt_len + n and n < len(produced):
                add(i, produced[n], "target")  # the step reached the end of the sequence: one new token
    if not seen:
        raise ValueError(f"request {rid!r} is not in the trace; was the LLM made with enable_trace=True?")
    return rows


def show_token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"


def step_rows(sources: list[dict], tokenizer=None) -> list[dict]:
    """One row per engine step that produced tokens: accepted, rejected, and the target's token."""
    rows = []
    for step, group in itertools.groupby(sources, key=lambda r: r["step"]):
        group = list(group)
        own = [r for r in group if r["kind"] in ("target", "replacement", "bonus")]
        text = {kind: " ".join(repr(show_token(tokenizer, r["token_id"])) for r in group if r["kind"] == kind)
                for kind in ("accepted", "rejected")}
        drafts = [r for r in group if r["draft_index"] is not None]
        rows.append({"step": step, "drafts": len(drafts),
                     "accepted": sum(r["kind"] == "accepted" for r in group),
                     "accepted tokens": text["accepted"] or "-", "rejected tokens": text["rejected"] or "-",
                     "target's token": (repr(show_token(tokenizer, own[0]["token_id"])) + f" ({own[0]['kind']})")
                     if own else "-"})
    return rows


def spec_tokens_text(sources: list[dict], tokenizer=None) -> str:
    """The plain-text form of the coloured stream: one line per step."""
    return format_table(step_rows(sources, tokenizer), id_columns=("step",)) + (
        "\nA step emits its accepted drafts, then one token of the target's: a replacement for the first "
        "rejected draft (the drafts after it are thrown away unchecked), or a bonus token when all were "
        "accepted. 'target' marks a step with no drafts: the prompt's prefill, or a step where the proposer "
        "had nothing to offer.")


@dataclass
class SpecTokens:
    """The stream of a request with every token coloured by where it came from; drawn as HTML,
    and as the per-step table where HTML is not drawn."""

    sources: list[dict]
    tokenizer: object = None
    prompt: str = ""
    title: str = ""

    def html(self) -> str:
        legend = " ".join(_span(kind, kind) for kind in KINDS)
        body = "".join(_span(r["kind"], show_token(self.tokenizer, r["token_id"]),
                             title=f"step {r['step']}: {r['kind']}" + (
                                 f", draft {r['draft_index'] + 1}" if r["draft_index"] is not None else ""))
                       for r in self.sources)
        prompt = f"<span style='color:#888'>{_escape(self.prompt)}</span>" if self.prompt else ""
        title = f"<b>{html.escape(self.title)}</b><br>" if self.title else ""
        return (f"<div>{title}<small>{legend}</small>"
                f"<pre style='white-space:pre-wrap;line-height:1.7;font-size:12px'>{prompt}{body}</pre></div>")

    def text(self) -> str:
        return (self.title + "\n" if self.title else "") + spec_tokens_text(self.sources, self.tokenizer)

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/html": self.html(), "text/plain": self.text()}

    def __repr__(self) -> str:
        return self.text()


def _escape(text: str) -> str:
    return html.escape(text).replace("\n", "\u21b5\n")  # a visible mark where a line ends


def _span(kind: str, text: str, title: str = "") -> str:
    strike = "text-decoration:line-through;" if kind == "rejected" else ""
    tip = f" title='{html.escape(title)}'" if title else ""
    return (f"<span style='background:{KIND_COLORS[kind]};{strike}border-radius:2px;padding:0 1px'"
            f"{tip}>{_escape(text)}</span>")


# -- acceptance per draft position -----------------------------------------------------------------
def acceptance_by_position(trace: list[dict], k: int | None = None) -> list[dict]:
    """Per draft position i (1-based): how often a draft was proposed there, how often the sampler
    reached it (every earlier draft accepted), how often it was accepted.

    `acceptance rate` = accepted / proposed is vLLM's per-position rate (its
    spec_decode_num_accepted_tokens_per_pos over the number of drafts); `conditional rate` =
    accepted / reached is the chance of acceptance once the sampler gets there, the alpha of
    Leviathan et al. if every position were alike.
    """
    steps = [s for e in trace for s in e["scheduled"] if "emitted_token_ids" in s]
    k = k if k is not None else max([len(s["draft_token_ids"]) for s in steps], default=0)
    proposed, reached, accepted = [0] * k, [0] * k, [0] * k
    for s in steps:
        a = len(s["emitted_token_ids"]) - 1
        for i in range(min(k, len(s["draft_token_ids"]))):
            proposed[i] += 1
            reached[i] += i <= a
            accepted[i] += i < a
    return [{"position": i + 1, "proposed": proposed[i], "reached": reached[i], "accepted": accepted[i],
             "acceptance rate": accepted[i] / proposed[i] if proposed[i] else 0.0,
             "conditional rate": accepted[i] / reached[i] if reached[i] else 0.0} for i in range(k)]


def position_figure(rows_by_label: dict[str, list[dict]], rate: str = "acceptance rate",
                    title: str = "") -> go.Figure:
    """Grouped bars: the rate at each draft position, one colour per method."""
    fig = go.Figure()
    for label, rows in rows_by_label.items():
        fig.add_trace(go.Bar(x=[r["position"] for r in rows], y=[round(r[rate], 4) for r in rows], name=label,
                             marker_color=METHOD_COLORS.get(label.split()[0])))
    fig.update_layout(barmode="group", title=title or f"{rate} per draft position", height=370,
                      margin=dict(l=50, r=10, t=40, b=90), xaxis=dict(title="draft position", dtick=1),
                      yaxis=dict(title=rate, range=[0, 1]), legend=LEGEND_BELOW)
    return fig


# -- runs over k and temperature ---------------------------------------------------------------------
@dataclass
class SpecRun:
    """One configuration's run: what it generated, the engine trace and the spec-decode counters."""

    method: str
    k: int
    temperature: float
    outputs: list = field(default_factory=list, repr=False)
    trace: list[dict] = field(default_factory=list, repr=False)
    metrics: dict = field(default_factory=dict, repr=False)
    tokenizer: object = field(default=None, repr=False)

    def row(self) -> dict:
        m = self.metrics
        drafts, proposed = m["spec_decode_num_drafts"], m["spec_decode_num_draft_tokens"]
        accepted = m["spec_decode_num_accepted_tokens"]
        tokens = sum(len(o.outputs[0].token_ids) for o in self.outputs)
        return {"method": self.method, "k": self.k, "temperature": self.temperature,
                "verifications": int(drafts), "draft tokens": int(proposed), "accepted": int(accepted),
                "acceptance rate": accepted / proposed if proposed else 0.0,
                "acceptance length": m["spec_decode_mean_acceptance_length"],
                "tokens": tokens, "engine steps": len(self.trace)}


def run_spec(make_llm, prompts: list, method: dict | None = None, k: int = 4, temperature: float = 0.0,
             max_tokens: int = 48, seed: int = 0, name: str | None = None) -> SpecRun:
    """Generate `prompts` on a fresh engine with `method` (a speculative_config without k; None =
    plain decoding, recorded as k = 0). Sampling is seeded per request, so a configuration always
    draws the same tokens. `make_llm(**knobs)` must return an LLM made with enable_trace=True."""
    if method is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"k (num_speculative_tokens) must be an integer >= 1, got {k!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    config = None if method is None else {**method, "num_speculative_tokens": k}
    k = 0 if method is None else k
    llm = make_llm(speculative_config=config)
    if llm.llm_engine.trace is None:
        raise ValueError("run_spec needs make_llm to return an LLM created with enable_trace=True")
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed + i)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    label = name or ("plain" if method is None else method["method"])
    return SpecRun(label, k, float(temperature), outputs, llm.llm_engine.trace, llm.get_metrics(), llm.tokenizer)


def acceptance_sweep(make_llm, prompts: list, methods: dict[str, dict], ks: list[int],
                     temperatures: list[float], max_tokens: int = 48, seed: int = 0) -> dict[tuple, SpecRun]:
    """Every (method name, k, temperature) combination, run once: {(name, k, temperature): SpecRun}."""
    return {(name, k, float(t)): run_spec(make_llm, prompts, method, k, t, max_tokens, seed, name=name)
            for name, method in methods.items() for k in ks for t in temperatures}


def sweep_figure(rows: list[dict], x: str = "k", title: str = "") -> go.Figure:
    """Acceptance length against k or temperature, one line per method; against k, the ceiling
    k + 1 (every draft accepted, plus the bonus token) for scale."""
    if x not in ("k", "temperature"):
        raise ValueError(f"x must be 'k' or 'temperature', got {x!r}")
    fig = go.Figure()
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r[x])
        fig.add_trace(go.Scatter(x=[r[x] for r in mine], y=[round(r["acceptance length"], 4) for r in mine],
                                 name=method, mode="lines+markers", line=dict(color=METHOD_COLORS.get(method))))
    if x == "k":
        ks = sorted({r["k"] for r in rows})
        fig.add_trace(go.Scatter(x=ks, y=[k + 1 for k in ks], name="k + 1 (all accepted)", mode="lines",
                                 line=dict(color="#999", dash="dot")))
    fig.update_layout(title=title, height=380, margin=dict(l=50, r=10, t=40, b=90),
                      xaxis_title="num_speculative_tokens (k)" if x == "k" else "temperature",
                      yaxis_title="mean acceptance length", legend=LEGEND_BELOW)
    return fig


def spec_widget(make_llm, prompts: list, methods: dict[str, dict], method: str = "draft_model", k: int = 4,
                temperature: float = 0.0, max_tokens: int = 48) -> LessonWidget:
    """Pick a method, k and temperature; the prompts run again and the first request's tokens are
    drawn coloured, with the acceptance counters and the rate per draft position."""
    if method not in methods:
        raise ValueError(f"method must be one of {', '.join(methods)}, got {method!r}")
    style = LABEL_STYLE
    pick = widgets.Dropdown(options=list(methods), value=method, description="method", style=style)
    k_slider = widgets.IntSlider(value=k, min=1, max=8, description="k", continuous_update=False, style=style)
    temp = widgets.FloatSlider(value=temperature, min=0.0, max=1.5, step=0.25, description="temperature",
                               continuous_update=False, style=style)
    out = widgets.Output()

    def redraw(*_):
        run = run_spec(make_llm, prompts, methods[pick.value], k_slider.value, temp.value, max_tokens)
        first = run.outputs[0]
        tokens = SpecTokens(token_sources(run.trace, first), run.tokenizer,
                            title=f"{pick.value}, k={k_slider.value}, temperature={temp.value}: request 1 "
                                  f"of {len(prompts)}")
        row = run.row()
        summary = format_table([row], columns=["verifications", "draft tokens", "accepted", "acceptance rate",
                                               "acceptance length", "engine steps"])
        show_outputs(out, tokens, summary,
                     position_figure({pick.value: acceptance_by_position(run.trace, k_slider.value)}))

    for w in (pick, k_slider, temp):
        w.observe(redraw, names="value")
    redraw()
    return LessonWidget("speculative decoding: method, k, temperature", [widgets.HBox([pick, k_slider, temp]), out])


# -- speedup: Leviathan et al.'s model and the measurements --------------------------------------------
def speedup_model_rows(alpha: float, c: float, ks: list[int]) -> list[dict]:
    """For each k: expected tokens per target forward and the predicted walltime speedup."""
    if not 0 <= alpha <= 1 or c < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and c >= 0, got alpha={alpha}, c={c}")
    return [{"k": k, "tokens per target forward": expected_tokens_per_step(alpha, k),
             "predicted speedup": predicted_speedup(alpha, k, c)} for k in ks]


def speedup_model_figure(alphas: list[float], c: float, ks: list[int], title: str = "") -> go.Figure:
    """Predicted speedup against k, one line per acceptance rate alpha, for draft cost c."""
    fig = go.Figure()
    for alpha in alphas:
        rows = speedup_model_rows(alpha, c, ks)
        fig.add_trace(go.Scatter(x=ks, y=[round(r["predicted speedup"], 4) for r in rows], name=f"alpha = {alpha:g}",
                                 mode="lines+markers"))
    fig.add_hline(y=1, line=dict(color="#999", dash="dot"))
    fig.update_layout(title=title or f"predicted speedup, draft cost c = {c:g}", height=380,
                      margin=dict(l=50, r=10, t=40, b=90), xaxis=dict(title="k", dtick=1),
                      yaxis_title="speedup over plain decoding", legend=LEGEND_BELOW)
    return fig


def speedup_model_widget(alpha: float = 0.6, c: float = 0.1, max_k: int = 10) -> LessonWidget:
    """Sliders for alpha and c: the predicted speedup for every k, and the best k."""
    style = LABEL_STYLE
    a = widgets.FloatSlider(value=alpha, min=0.0, max=0.95, step=0.05, description="alpha (acceptance)",
                            continuous_update=False, style=style)
    cost = widgets.FloatSlider(value=c, min=0.0, max=1.0, step=0.02, description="c (draft / target cost)",
                               continuous_update=False, style=style)
    out = widgets.Output()
    ks = list(range(1, max_k + 1))

    def redraw(*_):
        rows = speedup_model_rows(a.value, cost.value, ks)
        best = max(rows, key=lambda r: r["predicted speedup"])
        show_outputs(out, speedup_model_figure([a.value], cost.value, ks),
                     format_table(rows) + f"\nbest k = {best['k']}: {best['predicted speedup']:.2f}x")

    for w in (a, cost):
        w.observe(redraw, names="value")
    redraw()
    return LessonWidget("Leviathan et al.'s speedup model", [widgets.HBox([a, cost]), out])


def speedup_rows(result: dict) -> list[dict]:
    """The table of `llmopt.bench.spec.bench_spec`'s result, one row per configuration (batch 1).

    Two predictions: Leviathan et al.'s, where verifying k + 1 tokens costs one decode step
    (verify = 1), and the same formula with the measured verification cost in its place."""
    rows = []
    for key, run in result["runs"].items():
        method, k = key.split(":")
        b1 = run["batch1"]
        plain = key == "plain:0"
        rows.append({"method": method, "k": "-" if plain else int(k),
                     "acceptance length": b1["mean_acceptance_length"],
                     "target forwards / token": b1["forwards_per_token"],
                     "ms / token": b1["ms_per_token"], "speedup": run["speedup_batch1"],
                     "c": None if plain else run["c"], "verify": None if plain else run["verify_cost"],
                     "predicted, verify = 1": None if plain else run["predicted_speedup_v1"],
                     "predicted, measured verify": None if plain else run["predicted_speedup"],
                     "same tokens": f"{result['same_tokens'][key]}/{result['batch1_requests']}"})
    return rows


def speedup_figure(result: dict, title: str = "") -> go.Figure:
    """Measured speedup at batch 1 beside the formula's two predictions, per method; and the
    target forwards each token cost."""
    rows = [r for r in speedup_rows(result) if r["method"] != "plain"]
    labels = [f"{r['method']} k={r['k']}" for r in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("speedup at batch 1 (CPU time)",
                                                        "target forwards per generated token"))
    fig.add_trace(go.Bar(x=labels, y=[round(r["speedup"], 3) for r in rows], name="measured",
                         marker_color="#1f77b4"), row=1, col=1)
    for name, color in (("predicted, verify = 1", "#bbbbbb"), ("predicted, measured verify", "#ff7f0e")):
        fig.add_trace(go.Bar(x=labels, y=[round(r[name], 3) for r in rows], name=name, marker_color=color),
                      row=1, col=1)
    fig.add_trace(go.Bar(x=["plain"] + labels, y=[round(r["target forwards / token"], 3)
                                                   for r in speedup_rows(result)],
                         name="forwards / token", marker_color="#2ca02c", showlegend=False), row=1, col=2)
    fig.add_hline(y=1, line=dict(color="#999", dash="dot"), row=1, col=1)
    fig.update_layout(barmode="group", title=title, height=340, margin=dict(l=50, r=10, t=50, b=40),
                      legend=dict(orientation="h", y=-0.2))
    return fig
