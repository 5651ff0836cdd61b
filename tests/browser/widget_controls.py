"""Find each widget a notebook drew, move one of its controls as a learner would, see it redraw.

A lesson widget is one top-level ipywidgets view in a cell's output (a `LessonWidget` VBox of
controls and an Output). Its *output* is what it shows besides its controls: the text and HTML
it prints and the data of every plotly figure in it. Moving a control must change that output;
a widget whose callback raises, or is not wired to the control, leaves it as it was.

Controls are moved with the mouse and keyboard (a slider's handle is dragged, a dropdown option
picked, a button clicked), never by setting widget state from script, so a view that draws but
does not send its change to the kernel fails too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from playwright.sync_api import Locator, Page

TAG = "data-lesson-widget"

# Marks the output of every top-level widget view (one not inside another widget) with its index,
# in page order, and says which of them draw an error instead of the widget (the manager then puts
# its "Error displaying widget" text in the output itself).
MARK_WIDGETS = """() => {
  const roots = [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')]
      .filter(el => el.classList.contains('jupyter-widgets') || el.querySelector(':scope > .jupyter-widgets'))
      .filter(el => el.parentElement.closest('.jupyter-widgets') === null);
  roots.forEach((el, i) => el.setAttribute('%s', String(i)));
  return roots.map(el => ({text: el.innerText.slice(0, 300),
                           error: /Error displaying widget|Model not found/i.test(el.innerText)}));
}""" % TAG

# Everything a widget shows besides its controls, as one string to compare before and after a move.
SNAPSHOT = """(root) => {
  const texts = [...root.querySelectorAll('.widget-output, .widget-html-content, .widget-htmlmath-content')]
      .map(el => el.innerText);
  const plots = [...root.querySelectorAll('.js-plotly-plot')]
      .map(gd => JSON.stringify([gd.data, gd.layout && gd.layout.title, gd.layout && gd.layout.annotations]));
  return JSON.stringify([texts, plots]);
}"""

# Which kinds of control a widget has, in the order one is chosen to move.
CONTROL_KINDS = {
    "slider": ".widget-slider .noUi-handle",
    "dropdown": ".widget-dropdown select",
    "toggle buttons": ".widget-toggle-buttons button.widget-toggle-button",
    "button": "button.widget-button:not(.widget-toggle-button):not(.widget-play button)",
    "checkbox": ".widget-checkbox input[type=checkbox]",
    "multiple selection": ".widget-select-multiple select",
}


@dataclass
class Move:
    kind: str           # which control was moved ("slider", "dropdown", ...)
    label: str          # its description as the learner reads it
    before: str         # the control's value before and after
    after: str
    output_changed: bool
    seconds: float      # from the move until the output changed (or the wait ran out)


def mark_widgets(page: Page) -> list[dict]:
    return page.evaluate(MARK_WIDGETS)


def widget(page: Page, index: int) -> Locator:
    return page.locator(f"[{TAG}='{index}']")


def snapshot(root: Locator) -> str:
    return root.evaluate(SNAPSHOT)


def controls(root: Locator) -> dict[str, int]:
    """How many controls of each kind the widget holds."""
    return {kind: root.locator(sel).count() for kind, sel in CONTROL_KINDS.items()
            if root.locator(sel).count()}


def _label(control: Locator) -> str:
    box = control.locator("xpath=ancestor::*[contains(@class,'widget-inline-hbox')][1]")
    if box.count():
        label = box.locator(".widget-label").first
        if label.count() and label.inner_text().strip():
            return label.inner_text().strip()
    return (control.inner_text() or control.get_attribute("title") or "").strip()


def _slider_value(handle: Locator) -> str:
    box = handle.locator("xpath=ancestor::*[contains(@class,'widget-slider')][1]")
    readout = box.locator(".widget-readout")
    return readout.inner_text().strip() if readout.count() else (handle.get_attribute("aria-valuetext") or "")


def _move_slider(page: Page, handle: Locator) -> tuple[str, str, str]:
    """Drag the handle a third of the track toward its far end; the arrow keys if that moved nothing."""
    label, before = _label(handle), _slider_value(handle)
    handle.scroll_into_view_if_needed()
    track = handle.locator("xpath=ancestor::*[contains(@class,'noUi-target')][1]").bounding_box()
    hb = handle.bounding_box()
    x, y = hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2
    right = x < track["x"] + track["width"] / 2
    target = x + (1 if right else -1) * track["width"] / 3
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(target, y, steps=8)
    page.mouse.up()
    if _slider_value(handle) == before:
        handle.focus()
        page.keyboard.press("ArrowRight" if right else "ArrowLeft")
    return label, before, _slider_value(handle)


def _move_select(select: Locator, multiple: bool) -> tuple[str, str, str]:
    options = select.locator("option").all_inner_texts()
    chosen = select.evaluate("s => [...s.selectedOptions].map(o => o.textContent)")
    if multiple:  # leave one out (or add one back), as a learner narrows a comparison
        pick = chosen[:-1] if len(chosen) > 1 else [o for o in options if o not in chosen][:1] + chosen
    else:
        i = options.index(chosen[0]) if chosen and chosen[0] in options else -1
        pick = [options[(i + 1) % len(options)]]
    select.scroll_into_view_if_needed()
    select.select_option(label=pick)
    return _label(select), ", ".join(chosen), ", ".join(pick)


def move_one_control(page: Page, root: Locator) -> tuple[str, str, str, str] | None:
    """Move the first control found (sliders first, then dropdowns, toggles, buttons, checkboxes,
    multiple selections); return (kind, label, value before, value after), or None if it has none."""
    for kind, sel in CONTROL_KINDS.items():
        found = root.locator(sel)
        if not found.count():
            continue
        control = found.first
        if kind == "slider":
            return (kind, *_move_slider(page, control))
        if kind in ("dropdown", "multiple selection"):
            return (kind, *_move_select(control, multiple=kind == "multiple selection"))
        if kind == "toggle buttons":
            control = root.locator(sel + ":not(.mod-active)").first
            before = root.locator(sel + ".mod-active").first
            before_text = before.inner_text() if before.count() else ""
            control.scroll_into_view_if_needed()
            control.click()
            return kind, _label(control), before_text, control.inner_text()
        if kind == "checkbox":
            before = control.is_checked()
            control.scroll_into_view_if_needed()
            control.click()
            return kind, _label(control), str(before), str(control.is_checked())
        control.scroll_into_view_if_needed()
        control.click()
        return kind, _label(control), "", "clicked"
    return None


def move_and_watch(page: Page, root: Locator, timeout_s: float) -> Move | None:
    """Move one control and wait up to `timeout_s` for the widget's output to change."""
    before = snapshot(root)
    moved = move_one_control(page, root)
    if moved is None:
        return None
    start = time.monotonic()
    changed = False
    while time.monotonic() - start < timeout_s:
        if snapshot(root) != before:
            changed = True
            break
        page.wait_for_timeout(200)
    return Move(*moved, output_changed=changed, seconds=time.monotonic() - start)
