"""The Grafana dashboard of deploy/, drawn in a notebook from two live scrapes of the replicas.

Grafana asks Prometheus one PromQL query per line of each panel; Prometheus answers from the
samples it scraped. Here the notebook scrapes every replica's /metrics itself, twice (before
and after some load), and evaluates the dashboard's own queries on those two scrapes: a
`rate(x[...])` is the counter's growth between the scrapes divided by the seconds between
them, `histogram_quantile(q, ...)` interpolates inside the bucket that holds the q-th
observation (Prometheus's rule), a gauge is its value at the second scrape. Only the query
shapes the dashboard uses are understood; anything else raises ValueError naming it.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from llmopt.viz.notebook import LessonWidget, show_outputs


@dataclass
class Scrape:
    """Every sample of every replica at one moment: (name, labels incl. instance) -> value."""
    time: float
    samples: dict[tuple[str, tuple], float] = field(default_factory=dict)
    down: list[str] = field(default_factory=list)   # replicas that did not answer (up == 0)

    def series(self, name: str, selector: dict[str, str] | None = None) -> dict[tuple, float]:
        out = {}
        for (n, labels), v in self.samples.items():
            if n == name and all(re.fullmatch(pat, dict(labels).get(key, "")) for key, pat in (selector or {}).items()):
                out[labels] = v
        return out


def scrape(urls: list[str], timeout: float = 5.0) -> Scrape:
    """GET /metrics of each replica, as Prometheus does, labelling each sample with its instance."""
    from prometheus_client.parser import text_string_to_metric_families

    s = Scrape(time=time.monotonic())
    for url in urls:
        instance = url.removeprefix("http://").rstrip("/")
        try:
            text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout).text
        except httpx.HTTPError:
            s.down.append(instance)
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted({**sample.labels, "instance": instance}.items()))
                s.samples[(sample.name, labels)] = sample.value
    return s


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile: `buckets` are (upper bound `le`, cumulative count), the
    last one +Inf. The q-th observation falls in some bucket; assume the observations inside
    it are spread evenly between its lower and upper bound, and interpolate. If it falls in
    the +Inf bucket, the answer is the largest finite bound. No observations: nan."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


# -- the query shapes of deploy/grafana/dashboards/llmopt.json ---------------------------------------
_SELECTOR = re.compile(r'(\w+)(=~|=)"([^"]*)"')
_RATE = re.compile(r"rate\(([\w:]+)(\{[^}]*\})?\[[^\]]+\]\)")


def _selector(text: str | None) -> dict[str, str]:
    return {k: (v if op == "=~" else re.escape(v)) for k, op, v in _SELECTOR.findall(text or "")}


def evaluate(expr: str, before: Scrape, after: Scrape):
    """One dashboard query on two scrapes -> a number, or {legend label: number}."""
    expr = expr.strip()
    dt = max(after.time - before.time, 1e-9)
    m = re.fullmatch(r"histogram_quantile\(([\d.]+), sum by \(le\) \((.+)\)\)", expr)
    if m:
        rate = _RATE.fullmatch(m.group(2))
        name, sel = rate.group(1), _selector(rate.group(2))
        by_le: dict[float, float] = {}
        for labels, v in after.series(name, sel).items():
            le = float(dict(labels)["le"])
            by_le[le] = by_le.get(le, 0.0) + v - before.series(name, sel).get(labels, 0.0)
        return histogram_quantile(float(m.group(1)), list(by_le.items()))
    if " / " in expr:
        num, den = (evaluate(part, before, after) for part in expr.split(" / ", 1))
        return num / den if den else math.nan
    m = re.fullmatch(r"sum\((rate\(.+\))\)", expr)
    if m:
        rate = _RATE.fullmatch(m.group(1))
        name, sel = rate.group(1), _selector(rate.group(2))
        return sum(v - before.series(name, sel).get(labels, 0.0) for labels, v in after.series(name, sel).items()) / dt
    m = re.fullmatch(r"(sum|max) by \((\w+)\) \((.+)\)", expr)
    if m:
        agg, label, inner = m.groups()
        rate = _RATE.fullmatch(inner)
        name, sel = (rate.group(1), _selector(rate.group(2))) if rate else (inner, {})
        out: dict[str, float] = {}
        for labels, v in after.series(name, sel).items():
            if rate:
                v = (v - before.series(name, sel).get(labels, 0.0)) / dt
            key = dict(labels).get(label, "")
            out[key] = v if key not in out else (out[key] + v if agg == "sum" else max(out[key], v))
        return out
    if re.fullmatch(r'count\(up\{job="llmopt"\} == 0\)', expr):
        return float(len(after.down))
    raise ValueError(f"this notebook evaluates only the dashboard's query shapes; not {expr!r}")


def load_dashboard(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def panel_rows(dashboard: dict, before: Scrape, after: Scrape) -> list[dict]:
    """One row per query line of every panel: panel, legend, value (with its unit)."""
    rows = []
    for panel in dashboard["panels"]:
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        for target in panel["targets"]:
            value = evaluate(target["expr"], before, after)
            legend = target.get("legendFormat", "")
            items = value.items() if isinstance(value, dict) else [(None, value)]
            if not items:  # no series matched: Grafana draws "No data", so does the figure
                items = [("", None)]
            for key, v in items:
                label = re.sub(r"\{\{\s*\w+\s*\}\}", key or "", legend) if key is not None else legend
                rows.append({"panel": panel["title"], "series": label, "value": v, "unit": unit})
    return rows


def _show(v: float, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "no data"
    if unit == "s":
        return f"{v * 1e3:,.1f} ms"
    if unit == "percentunit":
        return f"{v:.1%}"
    return f"{v:,.2f}"


def text_panels(rows: list[dict]) -> str:
    """The same numbers as dashboard_figure, as text (for viewers that draw no plots)."""
    lines, last = [], None
    for r in rows:
        if r["panel"] != last:
            lines.append(r["panel"])
            last = r["panel"]
        lines.append(f"    {r['series']:<34} {_show(r['value'], r['unit'])}")
    return "\n".join(lines)


def dashboard_figure(rows: list[dict], columns: int = 3, title: str = "") -> go.Figure:
    """Each panel as a bar chart of its series' values (Grafana draws them over time; two
    scrapes give one point each)."""
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    n_rows = math.ceil(len(panels) / columns)
    fig = make_subplots(rows=n_rows, cols=columns, subplot_titles=panels, vertical_spacing=0.12)
    for i, panel in enumerate(panels):
        mine = [r for r in rows if r["panel"] == panel]
        unit = mine[0]["unit"]
        scale = 1e3 if unit == "s" else 100 if unit == "percentunit" else 1
        values = [0 if r["value"] is None or math.isnan(r["value"]) else r["value"] * scale for r in mine]
        fig.add_trace(go.Bar(x=[r["series"] for r in mine], y=values, showlegend=False,
                             text=[_show(r["value"], unit) for r in mine], textposition="auto"),
                      row=i // columns + 1, col=i % columns + 1)
        fig.update_yaxes(title_text={"s": "ms", "percentunit": "%"}.get(unit, unit), row=i // columns + 1,
                         col=i % columns + 1)
    fig.update_layout(height=300 * n_rows, title=title or "the llmopt dashboard, from two scrapes of the replicas",
                      margin=dict(t=80, b=40))
    return fig


def panel_queries(dashboard: dict, panel: str, rows: list[dict]) -> str:
    """One panel as Grafana's editor shows it: each PromQL line, then what it gave per series."""
    found = [p for p in dashboard["panels"] if p["title"] == panel]
    if not found:
        raise ValueError(f"no panel {panel!r}; the dashboard has: {[p['title'] for p in dashboard['panels']]}")
    lines = [f"{panel} (unit: {found[0]['fieldConfig']['defaults'].get('unit', '') or 'none'})", "PromQL:"]
    lines += [f"    {t['expr']}" for t in found[0]["targets"]]
    lines.append("on the two scrapes:")
    lines += text_panels([r for r in rows if r["panel"] == panel]).splitlines()[1:]  # (less the title line)
    return "\n".join(lines)


def dashboard_widget(dashboard: dict, rows: list[dict]) -> LessonWidget:
    """Pick a panel: its bars and the PromQL behind them, as Grafana's panel editor pairs them."""
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    pick = widgets.Dropdown(options=panels, description="panel")
    out = widgets.Output()

    def draw(*_):
        mine = [r for r in rows if r["panel"] == pick.value]
        show_outputs(out, dashboard_figure(mine, columns=1, title=pick.value).update_layout(height=320),
                     panel_queries(dashboard, pick.value, rows))

    pick.observe(draw, "value")
    draw()
    return LessonWidget("the dashboard panel by panel", [pick, out])
