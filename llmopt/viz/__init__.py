"""Widgets and plots for the lessons (ipywidgets, plotly); the engine never imports this."""
