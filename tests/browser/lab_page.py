"""One notebook in a JupyterLab browser tab: open it, run every cell, read what ran, shut its kernel.

The cells run through JupyterLab's own "Run All Cells" command, as the Run menu runs them, so
outputs travel the way they do for a learner: kernel -> server -> websocket -> JupyterLab's
renderers (plotly's JupyterLab extension, the ipywidgets manager). The notebook's model, read
back from the page, says what each cell produced; the page's DOM says what was drawn.
"""

from __future__ import annotations

import json
import time

from playwright.sync_api import Page

# The open notebook panel, its kernel and its model, as JupyterLab holds them.
PANEL = "window.jupyterapp.shell.currentWidget"
KERNEL = f"{PANEL}.sessionContext.session.kernel"


def open_notebook(page: Page, url: str, timeout_s: float) -> None:
    """Load JupyterLab at a notebook's URL and wait until its kernel is started and idle."""
    page.goto(url, wait_until="domcontentloaded", timeout=timeout_s * 1000)
    page.wait_for_function(
        f"() => window.jupyterapp && {PANEL} && {PANEL}.content && {PANEL}.sessionContext "
        f"&& {PANEL}.sessionContext.session && {PANEL}.sessionContext.session.kernel "
        f"&& {KERNEL}.status === 'idle' && {PANEL}.content.widgets.length > 0",
        timeout=timeout_s * 1000, polling=250)


def run_all_cells(page: Page, timeout_s: float, tick=None, tick_s: float = 1.0) -> bool:
    """Run > Run All Cells; return once every queued cell has run (False: one raised and the
    cells after it were not run, as in JupyterLab). `tick()` is called every `tick_s` meanwhile."""
    page.evaluate(
        "() => { window.__runAll = null; window.jupyterapp.commands.execute('notebook:run-all-cells')"
        ".then(ok => { window.__runAll = {ok: ok !== false}; },"
        "      err => { window.__runAll = {ok: false, error: String(err)}; }); }")
    deadline = time.monotonic() + timeout_s
    while (result := page.evaluate("() => window.__runAll")) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Run All Cells had not finished after {timeout_s:.0f} s")
        if tick is not None:
            tick()
        page.wait_for_timeout(tick_s * 1000)
    wait_kernel_idle(page, timeout_s)
    return bool(result["ok"])


def wait_kernel_idle(page: Page, timeout_s: float, settle_ms: int = 500) -> None:
    """Wait until the kernel has been idle for `settle_ms` (widget callbacks run as comm messages,
    which make the kernel busy without any cell running)."""
    page.evaluate(
        f"() => {{ const k = {KERNEL}; window.__idleSince = k.status === 'idle' ? Date.now() : null;"
        "  if (!window.__idleHooked) { window.__idleHooked = true;"
        "    k.statusChanged.connect((_, s) => { window.__idleSince = s === 'idle' ? Date.now() : null; }); } }")
    page.wait_for_function(
        f"() => window.__idleSince !== null && Date.now() - window.__idleSince >= {settle_ms}",
        timeout=timeout_s * 1000, polling=100)


def notebook_json(page: Page) -> dict:
    """The notebook as JupyterLab holds it now: every cell's outputs as it received them."""
    return json.loads(page.evaluate(f"() => JSON.stringify({PANEL}.content.model.toJSON())"))


def shut_down(page: Page) -> None:
    """Save the scratch copy (so that closing asks nothing) and shut the kernel down."""
    page.evaluate(f"async () => {{ const p = {PANEL}; await p.context.save(); await p.sessionContext.shutdown(); }}")
