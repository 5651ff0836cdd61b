"""Everything the browser suite checks about one notebook, run once in JupyterLab, as a report.

For a notebook it: opens it in a fresh page, runs every cell with Run All, and then finds
  - cells that raised, wrote to stderr, or never ran;
  - "Error displaying widget" / "Model not found" anywhere in the page;
  - plotly figures and widgets: how many the stored notebook has, how many this run displayed,
    how many the page drew (a figure counts once its SVG is there; figures inside widgets too);
  - for every widget: one control moved (slider, dropdown, toggle, button, ...) and its output
    changed, or, for the few widgets with no control (DISPLAY_ONLY), that they redrew while
    their cell ran;
  - JavaScript errors in the console that are not in HARMLESS_CONSOLE;
and saves a screenshot of the page and of every widget. `problems` empty means the learner's
view worked.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from playwright.sync_api import Browser

import lab_page
import cpu_time
import kernel_messages
import nbval_in_browser
import tree_memory
import widget_controls

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_TEXT = re.compile(r"^\[interactive widget: (.*); run the notebook to use it\]")  # LessonWidget's repr

# Widgets with no control to move: what is checked instead, and why that is the right check.
DISPLAY_ONLY = {
    "live load dashboard: TTFT, TPOT, throughput, KV usage":
        "it redraws by itself while its cell's load test runs (checked: it drew at least two "
        "different states during the run); the learner changes the load in code, not with a control",
}

# JavaScript console errors that are not a fault of the lessons or of what the learner sees:
# (pattern, why it is harmless). Anything else logged as an error fails the lesson. Empty: in
# every run so far JupyterLab 4.6, ipywidgets 8.1 and plotly 7.1 logged no error on any lesson.
HARMLESS_CONSOLE: list[tuple[re.Pattern, str]] = []

# Binder's memory for the whole container: a lesson whose kernel and the processes it starts
# together hold more (tree_memory.py says how it is counted) is killed there.
MEMORY_LIMIT_BYTES = 2.0e9

DRAWN_PLOTS = """() => {
  const plots = [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')];
  const drawn = el => el.querySelector('.main-svg') !== null;
  const top = plots.filter(el => el.closest('.jupyter-widgets') === null);
  const inner = plots.filter(el => el.closest('.jupyter-widgets') !== null);
  return {top: top.length, top_drawn: top.filter(drawn).length,
          in_widgets: inner.length, in_widgets_drawn: inner.filter(drawn).length};
}"""


@dataclass
class Counts:
    plots: int
    widgets: int
    titles: list[str]


@dataclass
class Report:
    name: str
    problems: list[str] = field(default_factory=list)
    stored: Counts | None = None
    ran: Counts | None = None
    drawn: dict | None = None
    moves: list[str] = field(default_factory=list)
    console: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    nbval_cells: int = 0   # cells nbval checked on this run (0: nbval was not asked for)
    cpu_seconds: dict = field(default_factory=dict)  # by process kind: the kernel's vs the browser's cost
    peak_memory_gb: dict = field(default_factory=dict)  # the kernel and its processes: PSS and RSS summed
    over_memory_limit: bool = False  # more than Binder's 2 GB at the peak

    def summary(self) -> str:
        lines = [f"{self.name}: {self.seconds}, nbval cells checked on this run: {self.nbval_cells}",
                 f"  CPU seconds {self.cpu_seconds}",
                 f"  peak memory of the kernel and its processes, GB {self.peak_memory_gb}"
                 + (f" (OVER Binder's {MEMORY_LIMIT_BYTES / 1e9:.1f} GB)" if self.over_memory_limit else ""),
                 f"  stored {self.stored}", f"  ran    {self.ran}", f"  drawn  {self.drawn}"]
        lines += [f"  {m}" for m in self.moves]
        lines += [f"  console (harmless): {c}" for c in self.console]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        return "\n".join(lines)


def count_outputs(nb: dict) -> Counts:
    """Plotly figures and widgets among a notebook's cell outputs (stored or just run)."""
    plots, titles = 0, []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            data = out.get("data", {})
            plots += PLOTLY in data
            text = "".join(data.get("text/plain", ""))
            m = WIDGET_TEXT.match(text)
            if WIDGET_VIEW in data or m:
                titles.append(m.group(1) if m else text[:80])
    return Counts(plots=plots, widgets=len(titles), titles=titles)


def output_problems(nb: dict) -> list[str]:
    problems = []
    code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code_cells):
        where = f"code cell {i} ({''.join(cell['source']).strip().splitlines()[0][:60] if cell['source'] else ''!r})"
        if cell.get("execution_count") is None:
            problems.append(f"{where} did not run")
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                problems.append(f"{where} raised {out['ename']}: {out['evalue'][:300]}")
            elif out["output_type"] == "stream" and out.get("name") == "stderr":
                problems.append(f"{where} wrote to stderr: {''.join(out['text'])[:300]!r}")
    return problems


def harmless_reason(message: str) -> str | None:
    for pattern, reason in HARMLESS_CONSOLE:
        if pattern.search(message):
            return reason
    return None


def check_notebook(browser: Browser, lab, path: Path, shots: Path, *, nbval_items=None,
                   run_timeout_s: float = 1800, move_timeout_s: float = 90, idle_timeout_s: float = 240) -> Report:
    """Run `path` (a notebook in the server's root) in a fresh page and check what the learner sees;
    with `nbval_items` (nbval's items for this notebook), make nbval's check on the same run.
    A moved control must change its widget's output within `move_timeout_s`; its callback may then
    run on (one that builds engines can take a minute beside CI's other worker) until the kernel is
    idle, within `idle_timeout_s`, before the next control moves."""
    report = Report(name=path.stem)
    report.stored = count_outputs(nbformat.read(path, as_version=4))
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"JavaScript console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"JavaScript uncaught: {e}"))
    # The console says only "the server responded with a status of 500"; this names the request.
    page.on("response", lambda r: errors.append(f"server answered {r.status} to {r.request.method} "
                                                f"{r.url.split('?')[0]}") if r.status >= 500 else None)
    t0, cpu0 = time.monotonic(), cpu_time.cpu_seconds()
    memory = tree_memory.PeakMemory(lab.proc.pid).start()
    try:
        lab_page.open_notebook(page, lab.lab_url(path.name), timeout_s=120)
        report.seconds["open"] = round(time.monotonic() - t0, 1)
        live: dict[int, set] = {}

        def watch_live():  # what the widgets without controls show, sampled while cells run
            for i, _ in enumerate(widget_controls.mark_widgets(page)):
                live.setdefault(i, set()).add(widget_controls.snapshot(widget_controls.widget(page, i)))

        kernel_messages.start_recording(page)
        t1 = time.monotonic()
        lab_page.run_all_cells(page, timeout_s=run_timeout_s, tick=watch_live)
        report.seconds["run"] = round(time.monotonic() - t1, 1)
        if nbval_items:
            report.problems += nbval_in_browser.check(nbval_items, *kernel_messages.recorded(page))
            report.nbval_cells = len(nbval_items)
        _check_run(page, report, live)
        t2 = time.monotonic()
        _check_widgets(page, report, shots, move_timeout_s, idle_timeout_s)
        report.seconds["widgets"] = round(time.monotonic() - t2, 1)
        stray = kernel_messages.stray_errors(*kernel_messages.recorded(page), kernel_messages.page_comms(page))
        for text in dict.fromkeys(stray):
            report.problems.append(f"the kernel reported outside any cell (a widget callback): {text[-500:]}")
        page.screenshot(path=str(shots / f"{path.stem}.png"))
        report.cpu_seconds = cpu_time.since(cpu0)
        lab_page.shut_down(page)
    except Exception as e:  # a page that never loads or a run that never ends is a finding too
        report.problems.append(f"{type(e).__name__}: {str(e)[:500]}")
        try:
            page.screenshot(path=str(shots / f"{path.stem}-failed.png"))
            lab_page.shut_down(page)
        except Exception:
            pass
    finally:
        context.close()
        memory.stop()
    report.peak_memory_gb = {"pss": round(memory.peak_pss / 1e9, 2), "rss": round(memory.peak_rss / 1e9, 2)}
    # Reported, not failed on: memory, like time, is a measurement (lessons/README.md's table, made
    # by scripts/lesson_table.py from these reports), and a sampled peak moves between runs.
    report.over_memory_limit = memory.peak_pss > MEMORY_LIMIT_BYTES
    for message in errors:
        reason = harmless_reason(message)
        if reason:
            report.console.append(f"{message[:200]} ({reason})")
        else:
            report.problems.append(message[:500])
    report.seconds["total"] = round(time.monotonic() - t0, 1)
    return report


def _check_run(page, report: Report, live: dict[int, set]) -> None:
    nb = lab_page.notebook_json(page)
    report.problems += output_problems(nb)
    report.ran = count_outputs(nb)
    _wait_drawn(page, report.ran)
    report.drawn = page.evaluate(DRAWN_PLOTS)
    text = page.locator(".jp-Notebook").inner_text()
    for bad in ("Error displaying widget", "Model not found"):
        if bad.lower() in text.lower():
            report.problems.append(f"the page shows {bad!r}")
    stored, ran, drawn = report.stored, report.ran, report.drawn
    if ran.plots != stored.plots:
        report.problems.append(f"the run displayed {ran.plots} plotly figures; the stored notebook has {stored.plots}")
    if drawn["top_drawn"] != ran.plots:
        report.problems.append(f"the page drew {drawn['top_drawn']} of the run's {ran.plots} plotly figures "
                               f"({drawn['top']} placed)")
    if drawn["in_widgets_drawn"] != drawn["in_widgets"]:
        report.problems.append(f"the widgets drew {drawn['in_widgets_drawn']} of their {drawn['in_widgets']} figures")
    if ran.titles != stored.titles:
        report.problems.append(f"the run displayed widgets {ran.titles}; the stored notebook has {stored.titles}")
    views = widget_controls.mark_widgets(page)
    if len(views) != ran.widgets:
        report.problems.append(f"the page drew {len(views)} widgets; the run displayed {ran.widgets}")
    for i, title in enumerate(ran.titles):
        if title in DISPLAY_ONLY and len(live.get(i, ())) < 2:
            report.problems.append(f"widget {title!r} never redrew while its cell ran")


def _wait_drawn(page, ran: Counts, timeout_s: float = 60) -> None:
    """Give plotly and the widget manager time to draw what arrived (both draw asynchronously);
    whatever is still missing after `timeout_s` is reported by the counts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        drawn = page.evaluate(DRAWN_PLOTS)
        if (drawn["top_drawn"] >= ran.plots and drawn["in_widgets_drawn"] == drawn["in_widgets"]
                and len(widget_controls.mark_widgets(page)) >= ran.widgets):
            break
        page.wait_for_timeout(250)
    page.wait_for_timeout(250)


def _check_widgets(page, report: Report, shots: Path, move_timeout_s: float, idle_timeout_s: float) -> None:
    views = widget_controls.mark_widgets(page)
    titles = report.ran.titles
    for i, view in enumerate(views):
        title = titles[i] if i < len(titles) else f"widget {i}"
        root = widget_controls.widget(page, i)
        if view["error"]:
            report.problems.append(f"widget {title!r} shows an error: {view['text'][:200]!r}")
            continue
        if title in DISPLAY_ONLY:
            report.moves.append(f"{title}: no control ({DISPLAY_ONLY[title]})")
        else:
            move = widget_controls.move_and_watch(page, root, move_timeout_s)
            if move is None:
                report.problems.append(f"widget {title!r} has no control to move "
                                       f"(add it to DISPLAY_ONLY with a reason if that is intended)")
            else:
                moved_at = time.monotonic()
                lab_page.wait_kernel_idle(page, idle_timeout_s)
                report.moves.append(f"{title}: moved {move.kind} {move.label!r} {move.before!r} -> "
                                    f"{move.after!r}; output changed: {move.output_changed} "
                                    f"({move.seconds:.1f} s; kernel idle after "
                                    f"{move.seconds + time.monotonic() - moved_at:.1f} s)")
                if not move.output_changed:
                    report.problems.append(
                        f"widget {title!r}: moving {move.kind} {move.label!r} from {move.before!r} to "
                        f"{move.after!r} did not change its output within {move_timeout_s:.0f} s")
                if re.search("Error displaying widget|Model not found", root.inner_text(), re.I):
                    report.problems.append(f"widget {title!r} shows an error after the move")
        root.screenshot(path=str(shots / f"{report.name}-widget{i}.png"))
