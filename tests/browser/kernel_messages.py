"""What the page's kernel connection sends and receives, recorded in the page while a notebook runs.

JupyterLab's kernel connection signals every message (`anyMessage`); the recorder keeps each
execute request (its id and code) and each output message on iopub, under the id of the request
that caused it, copied as it arrives (renderers change some of what they are given: plotly's
drops a figure's height and fills in its template). Outputs whose request is no cell's execute request came from a widget callback:
JupyterLab shows those only in its log console, so a callback that raises would go unseen in
the notebook; `stray_errors` finds them.
"""

from __future__ import annotations

import json
import re

from playwright.sync_api import Page

import lab_page

OUTPUT_TYPES = ("display_data", "execute_result", "stream", "error")

RECORD = """() => {
  const k = %s;
  window.__sent = []; window.__iopub = {}; window.__pageComms = {}; window.__kernelComms = {};
  k.anyMessage.connect((_, args) => {
    const m = args.msg;
    if (args.direction === 'send' && m.header.msg_type === 'execute_request') {
      window.__sent.push({id: m.header.msg_id, code: m.content.code});
    } else if (args.direction === 'send' && m.header.msg_type === 'comm_open') {
      window.__pageComms[m.content.comm_id] = m.content.target_name;
    } else if (args.direction === 'recv' && m.channel === 'iopub' && m.header.msg_type === 'comm_open') {
      window.__kernelComms[m.content.comm_id] = m.content.target_name;
    } else if (args.direction === 'recv' && m.channel === 'iopub' && m.parent_header && m.parent_header.msg_id
               && %s.includes(m.header.msg_type)) {
      (window.__iopub[m.parent_header.msg_id] = window.__iopub[m.parent_header.msg_id] || [])
        .push({msg_type: m.header.msg_type, content: structuredClone(m.content)});
    }
  });
}""" % (lab_page.KERNEL, list(OUTPUT_TYPES))


def start_recording(page: Page) -> None:
    page.evaluate(RECORD)


def _js_number(text: str) -> int | float:
    """A number JavaScript wrote as an integer: every number in the page is a double, and one of
    2**53 or more (a float such as 2.688086027586765e16) is written with all its digits; read back as
    an int it would no longer equal the float the kernel sent. Below 2**53 it is an exact int."""
    value = int(text)
    return value if abs(value) <= 2**53 else float(text)


def recorded(page: Page) -> tuple[list[dict], dict[str, list[dict]]]:
    """(execute requests in the order sent, {request id: its iopub output messages})."""
    text = page.evaluate("() => JSON.stringify([window.__sent, window.__iopub])")
    sent, iopub = json.loads(text, parse_int=_js_number)
    return sent, iopub


def page_comms(page: Page) -> dict[str, str]:
    """{comm id: target name} of the comms opened while the recorder ran, by the page (the widget
    manager's control comm) or by the kernel (every widget a cell made)."""
    return page.evaluate("() => Object.assign({}, window.__pageComms, window.__kernelComms)")


# The widget manager opens a control comm when it connects to a kernel, to ask for the state of
# widgets made before the page was there. A fresh kernel that has not imported ipywidgets yet has
# no such target: it logs "No such comm target registered: jupyter.widget.control" and drops the
# comm, and the manager's next message on it makes the kernel log "No such comm <id>". No widget
# exists then, so there is nothing to restore and nothing the learner misses. When the kernel was
# slow to start, the page opened the control comm (and the kernel may have logged the first line)
# before the recorder started, so neither the comm's opening nor that line is on record. The
# recorder starts before any cell runs, so every widget's comm (opened by the kernel) is on record:
# a "No such comm <id>" for an id nobody opened on record is the control comm's and harmless; for a
# widget's id it is a lost widget and is reported.
CONTROL_TARGET = "jupyter.widget.control"
HARMLESS_KERNEL_LOG = re.compile(r"^No such comm: (\S+)\s*$")
HARMLESS_NO_TARGET = re.compile(r"^No such comm target registered: " + re.escape(CONTROL_TARGET) + r"\s*$")


def _harmless(line: str, comms: dict[str, str]) -> bool:
    if HARMLESS_NO_TARGET.match(line):
        return True
    no_comm = HARMLESS_KERNEL_LOG.match(line)
    if not no_comm:
        return False
    return comms.get(no_comm.group(1), CONTROL_TARGET) == CONTROL_TARGET


def stray_errors(sent: list[dict], iopub: dict[str, list[dict]], comms: dict[str, str]) -> list[str]:
    """Errors and stderr the kernel sent in answer to no cell (a widget callback's), as text,
    less the widget manager's own control comm's (see HARMLESS_KERNEL_LOG)."""
    cells = {r["id"] for r in sent}
    stray = [m for parent, messages in iopub.items() if parent not in cells for m in messages]
    stderr = [m["content"]["text"] for m in stray if m["msg_type"] == "stream" and m["content"].get("name") == "stderr"]
    found = [f"{m['content']['ename']}: {m['content']['evalue']}" for m in stray if m["msg_type"] == "error"]
    for text in stderr:
        lines = [line for line in text.splitlines() if line.strip()]
        if not all(_harmless(line, comms) for line in lines):
            found.append(text)
    return found
