"""The request timeline: what each request was doing at every engine step.

A request waits in the queue, is prefilled (its prompt, in one step or in chunks), then
decodes one token per step until it finishes; under memory pressure it can be preempted,
losing its KV, and must wait and recompute it. `run_traced` drives the engine step by
step (requests may arrive at given steps) and keeps the trace; `static_batching` runs the
same requests the old way, one fixed batch at a time. The timeline is drawn in engine
steps, which are the same on every machine, or in seconds, which are not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmopt.sampling_params import SamplingParams
from llmopt.viz.block_table import pool_state
from llmopt.viz.notebook import LABEL_STYLE, LessonWidget, format_table, show_outputs

STATES = ("waiting", "prefill", "decode", "preempted", "recompute")
STATE_COLORS = {"waiting": "#d9d9d9", "prefill": "#ff7f0e", "decode": "#1f77b4",
                "preempted": "#d62728", "recompute": "#9467bd"}
# one character per step in the text timeline
STATE_CHARS = {"waiting": ".", "prefill": "P", "decode": "d", "preempted": "x", "recompute": "R"}


@dataclass
class TracedRun:
    """A workload's run: outputs in submission order, the engine trace of its steps, and
    per request the step it arrived at and the steps that produced its tokens."""

    request_ids: list[str]
    outputs: list = field(default_factory=list)          # RequestOutput, in submission order
    trace: list[dict] = field(default_factory=list)      # one entry per engine step of this run
    arrival_steps: dict[str, int] = field(default_factory=dict)
    token_steps: dict[str, list[int]] = field(default_factory=dict)
    prompt_lens: dict[str, int] = field(default_factory=dict)
    seqs: dict = field(default_factory=dict)             # request id -> engine Sequence
    label: str = ""

    @property
    def num_steps(self) -> int:
        return len(self.trace)


def run_traced(llm, prompts: list, params: SamplingParams | list[SamplingParams],
               arrival_steps: list[int] | None = None, priorities: list[int] | None = None,
               arrival_time: float | None = None, label: str = "") -> TracedRun:
    """Submit `prompts` to the engine (request i at step arrival_steps[i]) and step it until
    all are done, recording a pool snapshot after every step.

    The LLM must have been made with enable_trace=True. `arrival_time` sets every request's
    arrival clock (TTFT is measured from it); by default a request arrives when it is added.
    """
    engine = llm.llm_engine
    if engine.trace is None:
        raise ValueError("run_traced needs an LLM created with enable_trace=True")
    n = len(prompts)
    params = list(params) if isinstance(params, (list, tuple)) else [params] * n
    arrival_steps = list(arrival_steps) if arrival_steps is not None else [0] * n
    priorities = list(priorities) if priorities is not None else [0] * n
    if not len(params) == len(arrival_steps) == len(priorities) == n:
        raise ValueError(f"give one sampling params, arrival step and priority per prompt ({n})")
    base = engine.stats["num_requests"]  # ids stay unique across runs on one engine
    ids = [f"r{base + i}" for i in range(n)]
    run = TracedRun(ids, label=label, arrival_steps=dict(zip(ids, arrival_steps)),
                    token_steps={rid: [] for rid in ids})
    pending = sorted(range(n), key=lambda i: (arrival_steps[i], i))
    done, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and arrival_steps[pending[0]] <= step:
            i = pending.pop(0)
            seq = engine.add_request(ids[i], prompts[i], params[i], arrival_time=arrival_time,
                                     priority=priorities[i])
            run.seqs[ids[i]] = seq
            run.prompt_lens[ids[i]] = len(seq.prompt_token_ids)
        start = time.perf_counter()
        outputs = engine.step()
        entry = engine.trace[-1]
        entry["start_time"] = start
        entry["pool"] = pool_state(engine.block_manager)
        run.trace.append(entry)
        for out in outputs:
            if out.request_id in run.token_steps:
                run.token_steps[out.request_id].append(step)
                if out.finished:
                    done[out.request_id] = out
        step += 1
    run.outputs = [done[rid] for rid in ids]
    return run


def static_batching(llm, prompts: list, params: SamplingParams | list[SamplingParams],
                    batch_size: int, label: str = "static batching") -> TracedRun:
    """The pre-vLLM way: take `batch_size` requests, run them until *all* have finished,
    only then take the next batch. Every request arrives at the start."""
    n = len(prompts)
    params = list(params) if isinstance(params, (list, tuple)) else [params] * n
    t0 = time.perf_counter()
    merged = TracedRun([], label=label)
    for i in range(0, n, batch_size):
        part = run_traced(llm, prompts[i:i + batch_size], params[i:i + batch_size], arrival_time=t0)
        offset = len(merged.trace)
        merged.request_ids += part.request_ids
        merged.outputs += part.outputs
        merged.trace += part.trace
        merged.prompt_lens.update(part.prompt_lens)
        merged.seqs.update(part.seqs)
        for rid in part.request_ids:
            merged.arrival_steps[rid] = 0
            merged.token_steps[rid] = [s + offset for s in part.token_steps[rid]]
    return merged


# -- states per step ---------------------------------------------------------------------------
def request_states(run: TracedRun) -> dict[str, list[str | None]]:
    """request id -> its state at each step (None before it arrives and after it finishes)."""
    states = {rid: [None] * run.num_steps for rid in run.request_ids}
    finished, preempted = set(), set()
    for i, entry in enumerate(run.trace):
        scheduled = {s["request_id"]: s["kind"] for s in entry["scheduled"]}
        for rid in run.request_ids:
            if rid in finished or i < run.arrival_steps.get(rid, 0):
                continue
            if rid in scheduled:
                kind = scheduled[rid]
                states[rid][i] = "recompute" if kind == "prefill" and rid in preempted else kind
            elif rid in preempted or rid in entry["preempted"]:
                states[rid][i] = "preempted"  # its KV is gone; it waits to recompute it
            else:
                states[rid][i] = "waiting"    # queued (or running, but left out of this step's budget)
        preempted |= set(entry["preempted"])
        for rid, kind in scheduled.items():
            if kind == "decode":
                preempted.discard(rid)  # recomputed: an ordinary running request again
        finished |= set(entry["finished"])
    return states


def segments(run: TracedRun) -> list[dict]:
    """Consecutive steps in one state merged: (request, state, first step, last step)."""
    out = []
    for rid, seq in request_states(run).items():
        start = None
        for i, s in enumerate(seq + [None]):
            if start is not None and (s != seq[start] if i < len(seq) else True):
                out.append({"request": rid, "state": seq[start], "first": start, "last": i - 1})
                start = None
            if s is not None and start is None:
                start = i
    return out


def timeline_text(run: TracedRun, width: int = 150) -> str:
    """One line per request, one character per step: . waiting, P prefill, d decode,
    x preempted, R recompute (prefill again after preemption); blank before arrival and after the end.
    Runs longer than `width` steps are cut into panels; a panel leaves out requests idle in it."""
    states = request_states(run)
    name_w = max([4] + [len(r) for r in run.request_ids])
    lines = []
    for lo in range(0, run.num_steps, width):
        hi = min(lo + width, run.num_steps)
        ruler = "".join(f"{i:<10}" for i in range(lo, hi, 10))  # a step number every 10
        lines.append(f"{'step':<{name_w}}  {ruler}".rstrip())
        for rid in run.request_ids:
            row = "".join(STATE_CHARS.get(s, " ") for s in states[rid][lo:hi])
            if row.strip():
                lines.append(f"{rid:<{name_w}}  {row}".rstrip())
        lines.append("")
    lines.append(". waiting   P prefill   d decode   x preempted   R recompute")
    return "\n".join(lines)


def timeline_figure(run: TracedRun, x: str = "step", title: str | None = None) -> go.Figure:
    """Horizontal bars per request, coloured by state; x in engine steps or in seconds."""
    if x not in ("step", "time"):
        raise ValueError("x must be 'step' or 'time'")
    starts, ends = _step_bounds(run) if x == "time" else (None, None)
    fig = go.Figure()
    segs = segments(run)
    for state in STATES:
        mine = [s for s in segs if s["state"] == state]
        if not mine:
            continue
        if x == "step":
            base = [s["first"] for s in mine]
            length = [s["last"] - s["first"] + 1 for s in mine]
        else:
            base = [round(starts[s["first"]], 4) for s in mine]
            length = [round(ends[s["last"]] - starts[s["first"]], 4) for s in mine]
        fig.add_trace(go.Bar(y=[s["request"] for s in mine], x=length, base=base, orientation="h",
                             name=state, marker_color=STATE_COLORS[state],
                             hovertext=[f"{s['request']}: {state}, steps {s['first']}-{s['last']}" for s in mine],
                             hoverinfo="text"))
    fig.update_layout(barmode="overlay", title=title if title is not None else run.label,
                      height=max(260, 80 + 22 * len(run.request_ids)),
                      xaxis_title="engine step" if x == "step" else "seconds since the first step",
                      margin=dict(l=60, r=10, t=40, b=40))
    # requests top to bottom in arrival order (r0 first), not in the order the state traces met them
    fig.update_yaxes(autorange="reversed", type="category", categoryorder="array",
                     categoryarray=list(run.request_ids))
    return fig


def _step_bounds(run: TracedRun) -> tuple[list[float], list[float]]:
    t0 = run.trace[0].get("start_time", run.trace[0]["time"])
    ends = [e["time"] - t0 for e in run.trace]
    starts = [e.get("start_time", prev) - t0 for e, prev in zip(run.trace, [t0] + [e["time"] for e in run.trace])]
    return starts, ends


# -- numbers ---------------------------------------------------------------------------------------
def step_summary(run: TracedRun, batch_slots: int | None = None) -> dict:
    """Counts that depend only on the schedule, never on the machine."""
    decode_steps = [e["num_decode_tokens"] for e in run.trace if e["num_decode_tokens"]]
    ttft = [run.token_steps[r][0] - run.arrival_steps[r] + 1 for r in run.request_ids]
    row = {"run": run.label, "requests": len(run.request_ids), "steps": run.num_steps,
           "tokens out": sum(len(o.outputs[0].token_ids) for o in run.outputs),
           "prefill tokens": sum(e["num_prefill_tokens"] for e in run.trace),
           "max running": max(e["num_running"] + len(e["finished"]) for e in run.trace),
           "mean decode batch": float(statistics.mean(decode_steps)) if decode_steps else 0.0,
           "preemptions": sum(len(e["preempted"]) for e in run.trace),
           "mean TTFT (steps)": float(statistics.mean(ttft))}
    if batch_slots:
        # slot-steps in which a request slot of the batch held nothing to decode
        row["idle slot-steps"] = batch_slots * run.num_steps - sum(
            len(e["scheduled"]) for e in run.trace)
    return row


def latency_rows(runs: dict[str, TracedRun]) -> list[dict]:
    """Measured TTFT and TPOT (ms) per run: median, 90th percentile, and throughput."""
    rows = []
    for name, run in runs.items():
        ttft = [o.metrics.ttft * 1e3 for o in run.outputs]
        tpot = [o.metrics.tpot * 1e3 for o in run.outputs if o.metrics.tpot is not None]
        seconds = run.trace[-1]["time"] - run.trace[0].get("start_time", run.trace[0]["time"])
        tokens = sum(len(o.outputs[0].token_ids) for o in run.outputs)
        rows.append({"run": name, "TTFT p50 ms": _pct(ttft, 50), "TTFT p90 ms": _pct(ttft, 90),
                     "TPOT p50 ms": _pct(tpot, 50), "TPOT p90 ms": _pct(tpot, 90),
                     "seconds": seconds, "tokens/s": tokens / seconds})
    return rows


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def latency_figure(runs: dict[str, TracedRun]) -> go.Figure:
    """TTFT and TPOT of every request, one box (with its points) per run."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token (ms)",
                                                        "time per output token (ms)"))
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"]
    for (name, run), color in zip(runs.items(), colors):
        ttft = [round(o.metrics.ttft * 1e3, 2) for o in run.outputs]
        tpot = [round(o.metrics.tpot * 1e3, 3) for o in run.outputs if o.metrics.tpot is not None]
        fig.add_trace(go.Box(y=ttft, name=name, boxpoints="all", marker_color=color, legendgroup=name),
                      row=1, col=1)
        fig.add_trace(go.Box(y=tpot, name=name, boxpoints="all", marker_color=color, legendgroup=name,
                             showlegend=False), row=1, col=2)
    fig.update_layout(height=360, margin=dict(l=50, r=10, t=40, b=40), showlegend=False)
    return fig


def step_tokens_figure(runs: dict[str, TracedRun]) -> go.Figure:
    """Tokens computed in each step, prefill and decode stacked, one panel per run."""
    fig = make_subplots(rows=len(runs), cols=1, shared_xaxes=True, subplot_titles=list(runs),
                        vertical_spacing=0.12)
    for i, run in enumerate(runs.values(), start=1):
        steps = list(range(run.num_steps))
        for kind, color in (("prefill", STATE_COLORS["prefill"]), ("decode", STATE_COLORS["decode"])):
            fig.add_trace(go.Bar(x=steps, y=[e[f"num_{kind}_tokens"] for e in run.trace], name=kind,
                                 marker_color=color, showlegend=i == 1, legendgroup=kind), row=i, col=1)
        fig.update_yaxes(title_text="tokens", row=i, col=1)
    fig.update_xaxes(title_text="engine step", row=len(runs), col=1)
    fig.update_layout(barmode="stack", height=180 + 170 * len(runs), margin=dict(l=50, r=10, t=40, b=40))
    return fig


def scheduler_widget(make_llm, prompts: list, params, arrival_steps: list[int] | None = None,
                     max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                     enable_chunked_prefill: bool = True) -> LessonWidget:
    """Sliders for the scheduler's knobs; each change re-runs the workload on a fresh engine
    (`make_llm(**knobs)` must return an LLM with enable_trace=True) and redraws the timeline."""
    style = LABEL_STYLE
    seqs = widgets.IntSlider(value=max_num_seqs, min=1, max=16, description="max_num_seqs",
                             continuous_update=False, style=style)
    budget = widgets.SelectionSlider(options=[16, 32, 64, 128, 256, 512, 1024, 2048],
                                     value=max_num_batched_tokens, description="max_num_batched_tokens",
                                     continuous_update=False, style=style)
    chunked = widgets.Checkbox(value=enable_chunked_prefill, description="enable_chunked_prefill", style=LABEL_STYLE)
    axis = widgets.ToggleButtons(style=LABEL_STYLE, options=["step", "time"], value="step", description="x axis")
    out = widgets.Output()

    def redraw(*_):
        llm = make_llm(max_num_seqs=seqs.value, max_num_batched_tokens=budget.value,
                       enable_chunked_prefill=chunked.value)
        try:
            run = run_traced(llm, prompts, params, arrival_steps, label="continuous batching")
        except ValueError as e:  # e.g. a prompt over the step budget with chunking off
            show_outputs(out, f"{e}")
            return
        summary = step_summary(run)
        latency = latency_rows({"this run": run})[0]
        text = (format_table([summary], columns=["steps", "tokens out", "mean decode batch",
                                                 "preemptions", "mean TTFT (steps)"])
                + f"\nmeasured: TTFT p50 {latency['TTFT p50 ms']:.1f} ms, "
                  f"TPOT p50 {latency['TPOT p50 ms'] or 0:.2f} ms, {latency['seconds']:.2f} s in all")
        show_outputs(out, timeline_figure(run, x=axis.value,
                                          title=f"max_num_seqs={seqs.value}, max_num_batched_tokens="
                                                f"{budget.value}, chunked prefill {'on' if chunked.value else 'off'}"),
                     text)

    for w in (seqs, budget, chunked, axis):
        w.observe(redraw, names="value")
    redraw()
    return LessonWidget("scheduler knobs and the request timeline",
                        [widgets.HBox([widgets.VBox([seqs, budget]), widgets.VBox([chunked, axis])]), out])
