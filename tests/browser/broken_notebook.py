"""A notebook with one healthy widget and one of each fault the browser suite must catch.

Its stored outputs are what a correct lesson would have stored (scripts/run_lessons.py keeps a
widget's text form, plotly figures as their JSON), so every fault shows up as a learner would
meet it: a slider whose callback raises, a widget whose model is gone, a figure that no longer
draws, an output that differs from the stored one, a JavaScript error, a cell that raises.
FAULTS maps each to the words the suite's report must contain.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook, new_output

SETUP = """\
import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import HTML, display

from llmopt.viz.notebook import LessonWidget, setup_notebook, show_outputs

_ = setup_notebook()"""

WIDGET = """\
def {name}():
    n = widgets.IntSlider(value=3, min=1, max=10, description="n")
    out = widgets.Output()

    def redraw(*_):
{body}

    n.observe(redraw, names="value")
    show_outputs(out, go.Figure(go.Bar(y=list(range(n.value)))), f"n = {{n.value}}")
    return LessonWidget("{title}", [n, out])


{name}()"""

HEALTHY = WIDGET.format(name="healthy", title="healthy",
                        body='        show_outputs(out, go.Figure(go.Bar(y=list(range(n.value)))), f"n = {n.value}")')
DEAD = WIDGET.format(name="dead_slider", title="dead slider", body='        raise ValueError("this callback is broken")')
GHOST = """\
# a view of a widget model the kernel never made (as after a kernel restart)
display({"application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                       "model_id": "0123456789abcdef0123456789abcdef"},
         "text/plain": "[interactive widget: ghost; run the notebook to use it]"}, raw=True)"""
LOST_FIGURE = 'print("the figure that was stored here is no longer displayed")'
WRONG_OUTPUT = "print(6 * 7)"
CONSOLE_ERROR = 'display(HTML("<script>console.error(\'deliberate console error\')</script>"))'
RAISES = 'raise RuntimeError("deliberate failure")'

FAULTS = {
    "dead slider": "widget 'dead slider': moving slider 'n'",
    "callback raises": "(a widget callback): ValueError: this callback is broken",
    "ghost": "widget 'ghost' shows an error",
    "lost figure": "the run displayed 0 plotly figures; the stored notebook has 1",
    "wrong output": "nbval Cell 5: Cell outputs differ",
    "console error": "JavaScript console.error: deliberate console error",
    "raises": "raised RuntimeError: deliberate failure",
}


def widget_text(title: str) -> dict:
    return new_output("execute_result", execution_count=1,
                      data={"text/plain": f"[interactive widget: {title}; run the notebook to use it]"})


def write(path: Path) -> Path:
    figure = {"data": [{"type": "bar", "y": [0, 1, 2]}], "layout": {}}
    cells = [
        (SETUP, []),
        (HEALTHY, [widget_text("healthy")]),
        (DEAD, [widget_text("dead slider")]),
        (GHOST, [new_output("display_data", data={
            "text/plain": "[interactive widget: ghost; run the notebook to use it]"})]),
        (LOST_FIGURE, [new_output("display_data", data={"application/vnd.plotly.v1+json": figure,
                                                        "text/plain": "Figure()"})]),
        (WRONG_OUTPUT, [new_output("stream", name="stdout", text="41\n")]),
        (CONSOLE_ERROR, [new_output("display_data", data={
            "text/html": "<script>console.error('deliberate console error')</script>",
            "text/plain": "<IPython.core.display.HTML object>"})]),
        (RAISES, []),
    ]
    nb = new_notebook(cells=[new_code_cell(src, outputs=outs, execution_count=i + 1)
                             for i, (src, outs) in enumerate(cells)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, path)
    return path
