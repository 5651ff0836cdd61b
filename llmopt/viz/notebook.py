"""What every lesson notebook needs besides the engine: plot rendering, text tables, exercise checks.

Plots are stored in the notebooks as plotly's JSON mimetype (no embedded plotly.js), which
JupyterLab, Notebook 7 and VS Code draw; Colab needs its own renderer and widget manager.
Every plot has a plain-text table of the same numbers beside it, for viewers that draw neither.
"""

from __future__ import annotations

import logging
import os
import sys
from numbers import Number
from typing import Callable

import ipywidgets as widgets

from llmopt.package_data import committed_result  # noqa: F401  (lessons import it from llmopt.viz)


def in_colab() -> bool:
    return "google.colab" in sys.modules


def lesson_threads(want: int) -> int:
    """The threads a lesson's section runs on: `want`, or fewer where this process may use fewer cores
    (its CPU affinity) or OMP_NUM_THREADS asks for fewer, as it does where the notebook shares the
    machine with other work. More threads than free cores make every parallel region wait for a
    descheduled thread, so a section measured that way would time the waiting."""
    cap = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    asked = os.environ.get("OMP_NUM_THREADS", "")
    if asked.isdigit() and int(asked) > 0:
        cap = min(cap, int(asked))
    return max(1, min(want, cap))


# Widget labels at their full width: ipywidgets' default (about 90 px) cuts "temperature" to "temperat…"
LABEL_STYLE = {"description_width": "initial"}


# A horizontal legend pinned to the figure's bottom edge (not the plot's), under the x-axis title;
# at the top it would collide with the title, just under the plot with the axis title.
LEGEND_BELOW = dict(orientation="h", yref="container", y=0.01, yanchor="bottom", x=0)


class _LongTextWarning(logging.Filter):
    """Drops transformers' "Token indices sequence length is longer than the specified maximum"
    warning: lessons tokenize whole texts and cut them into windows the model can take, so a long
    token list is intended, and the warning (a pink box in JupyterLab) only alarms."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer")


def setup_notebook() -> str:
    """Pick the plotly renderer for this frontend and return its name; silence the tokenizer's
    long-text warning (once, for the whole notebook)."""
    import plotly.io as pio

    logger = logging.getLogger("transformers.tokenization_utils_base")
    if not any(isinstance(f, _LongTextWarning) for f in logger.filters):
        logger.addFilter(_LongTextWarning())

    if in_colab():
        from google.colab import output

        output.enable_custom_widget_manager()  # Colab draws ipywidgets 8 only with this
        renderer = "colab"
    else:
        renderer = "plotly_mimetype"
    pio.renderers.default = renderer
    pio.templates.default = "plotly_white"
    return renderer


def format_table(rows: list[dict], columns: list[str] | None = None, floatfmt: str = ",.2f",
                 id_columns: tuple[str, ...] = ("token_id", "id", "position")) -> str:
    """A fixed-width text table: numbers right-aligned with thousands separators, text left.

    Columns named in `id_columns` hold labels, not quantities: no separators there.
    """
    columns = columns or list(rows[0])

    def cell(v, column):
        if isinstance(v, bool) or v is None:
            return "-" if v is None else str(v)
        if isinstance(v, int):
            return str(v) if column in id_columns else f"{v:,}"
        if isinstance(v, Number):
            return format(v, floatfmt)
        return str(v)

    cells = [[cell(r.get(c), c) for c in columns] for r in rows]
    numeric = [all(isinstance(r.get(c), Number) and not isinstance(r.get(c), bool) or r.get(c) is None
                   for r in rows) for c in columns]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def check_answer(name: str, get_answer: Callable[[], object], expected, hint: str = "",
                 rel_tol: float = 0.0) -> None:
    """Run the learner's answer and say whether it is right; an unanswered exercise is no error."""
    try:
        answer = get_answer()
    except (NotImplementedError, NameError):
        print(f"{name}: not answered yet. Fill in the exercise cell above, run it, then run this cell.")
        return
    if isinstance(expected, Number) and isinstance(answer, Number) and not isinstance(answer, bool):
        right = abs(answer - expected) <= rel_tol * abs(expected)
    else:
        right = answer == expected
    if right:
        print(f"{name}: correct ({_show(answer)}).")
    else:
        print(f"{name}: not yet: your answer is {_show(answer)}. {hint}".rstrip())


def _show(v) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else repr(v)


class LessonWidget(widgets.VBox):
    """A VBox whose text form names the widget, instead of dumping every child's state.

    Viewers that cannot run widgets (GitHub, nbviewer, a terminal) show this text; the
    lesson prints the same facts as a table in the next cell.
    """

    def __init__(self, title: str, children, **kwargs):
        super().__init__(children, **kwargs)
        self.title = title

    def __repr__(self) -> str:
        return f"[interactive widget: {self.title}; run the notebook to use it]"


def show_outputs(out: widgets.Output, *items) -> None:
    """Replace what an Output widget shows: figures are displayed, strings printed.

    Setting the widget's outputs directly (instead of `with out: display(...)`) keeps these
    displays inside the widget whichever client runs the cell: a browser, nbclient or nbval.
    """
    outputs = []
    for item in items:
        if isinstance(item, str):
            outputs.append({"output_type": "stream", "name": "stdout",
                            "text": item if item.endswith("\n") else item + "\n"})
        else:  # a plotly figure renders itself with the renderer setup_notebook chose
            outputs.append({"output_type": "display_data", "data": item._repr_mimebundle_(),
                            "metadata": {}})
    out.outputs = tuple(outputs)
