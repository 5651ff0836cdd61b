"""Widgets and plots for the lessons (ipywidgets, plotly); the engine never imports this.

Each view comes in three forms built from the same numbers: a function that computes them,
a plotly figure or ipywidgets panel that shows them, and a plain-text table for viewers
that draw neither.
"""

from llmopt.viz.claims import machine, measured, quoted
from llmopt.viz.notebook import check_answer, committed_result, format_table, in_colab, lesson_threads, setup_notebook
from llmopt.viz.spec import SpecTokens, spec_widget, token_sources

__all__ = ["check_answer", "committed_result", "format_table", "in_colab", "lesson_threads", "setup_notebook",
           "SpecTokens", "spec_widget", "token_sources", "machine", "measured", "quoted"]
