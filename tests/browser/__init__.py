"""The browser suite: the lessons run in JupyterLab in headless Chromium (see conftest.py)."""
