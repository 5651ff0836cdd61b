"""Lesson prose states what holds on any machine; measured numbers are printed by the cells that
measured them (llmopt.viz.claims), naming the machine.

The check here finds the figures a markdown cell states with a unit of time, speed or bandwidth,
or as a ratio ("1.6x"): outside code (spans and fenced blocks), formulas and blockquotes (a quoted
claim of the article the course follows is marked as a quote). At most 10 are left, and the count may
only fall: those are configuration values (a timeout, a retry's backoff), arithmetic on stated inputs
(Little's law, a formula's prediction) and a head count's ratio; each one is listed when the check fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
CODE = re.compile(r"```.*?```|`[^`\n]*`|\$[^$\n]*\$", re.S)  # fenced blocks (a solution's code) too
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s*(?:-|–|to)\s*\d[\d,]*(?:\.\d+)?)?"
                    r"(?:\s*(?:ms|s|µs|us|tok/s|tokens/s|GB/s)|[x×])(?![\w/])")
MOST = 10  # figures in the lessons' prose today; lower it as the lessons move them into their cells


def stated_figures(notebook: dict) -> list[tuple[int, str]]:
    """(cell index, the figure in its context) for every figure a markdown cell states."""
    found = []
    for i, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        lines = "".join(cell["source"]).splitlines()
        text = CODE.sub(" ", "\n".join(line for line in lines if not line.lstrip().startswith(">")))
        found += [(i, text[max(0, m.start() - 40):m.end() + 10].replace("\n", " "))
                  for m in FIGURE.finditer(text)]
    return found


def test_the_check_finds_measured_figures_and_passes_formulas_and_quotes():
    cell = lambda text: {"cells": [{"cell_type": "markdown", "source": [text]}]}  # noqa: E731
    assert len(stated_figures(cell("llmopt decodes 1.67x llama.cpp, a step in 6.8 ms, 28 GB/s"))) == 3
    assert len(stated_figures(cell("from 299 to 78 ms, 12-15 tok/s"))) == 2
    assert stated_figures(cell("`2 x 3` and $4 \\times 5$ and TP 2 x PP 2, 30 layers x 3 heads")) == []
    assert stated_figures(cell("> the article: 2-3x faster\nplain")) == []
    assert stated_figures(cell("```python\nq = torch.where(s > 0, s, 1.0)  # 3x\n```\nprose")) == []
    assert stated_figures({"cells": [{"cell_type": "code", "source": ["took 5 ms"]}]}) == []


def test_lesson_prose_states_no_more_measured_figures_than_before():
    found = [f"{nb.name} cell {i}: ...{context}..." for nb in sorted(LESSONS.glob("*.ipynb"))
             for i, context in stated_figures(json.loads(nb.read_text()))]
    assert len(found) <= MOST, "\n".join(found)


# A run time said in words ("about two minutes", "under a minute") is a measurement too: how long a
# lesson takes is measured by the browser suite and listed, with its machine, in lessons/README.md.
DURATION = re.compile(r"\b(?:about|under|over|in|takes?|took|runs?|only)\s+(?:about\s+)?"
                      r"(?:a|an|one|two|three|four|five|six|ten|a few|\d+)(?:\s+(?:to|or)\s+\w+)?\s+"
                      r"(?:minutes?|seconds?)\b", re.IGNORECASE)


def stated_durations(notebook: dict) -> list[tuple[int, str]]:
    """(cell index, the phrase) for every run time a markdown cell states in words."""
    return [(i, m.group(0)) for i, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "markdown"
            for m in DURATION.finditer(" ".join("".join(cell["source"]).split()))]


def test_the_duration_check_finds_run_times_in_words():
    cell = lambda text: {"cells": [{"cell_type": "markdown", "source": [text]}]}  # noqa: E731
    for said in ("About two minutes on 2 CPU cores", "runs in under a minute", "One to two minutes",
                 "each run takes about a minute", "takes 5 minutes"):
        assert stated_durations(cell(said.replace("One", "in one"))), said
    assert stated_durations(cell("scraped every few seconds; up to `timeout` seconds; a 5-second wait")) == []


def test_no_lesson_states_its_run_time_in_words():
    found = [f"{nb.name} cell {i}: {phrase}" for nb in sorted(LESSONS.glob("*.ipynb"))
             for i, phrase in stated_durations(json.loads(nb.read_text()))]
    assert not found, "\n".join(found)
