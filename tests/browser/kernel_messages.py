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
  window.__sent = []; window.__iopub = {}; window.__pageComms = {};
  k.anyMessage.connect((_, args) => {
    const m = args.msg;
    if (args.direction === 'send' && m.header.msg_type === 'execute_request') {
      window.__sent.push({id: m.header.msg_id, code: m.content.code});
    } else if (args.direction === 'send' && m.header.msg_type === 'comm_open') {
      window.__pageComms[m.content.comm_id] = m.content.target_name;
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
    """{comm id: target name} of the comms the page itself opened."""
    return page.evaluate("() => window.__pageComms")


# The widget manager opens a control comm when it connects to a kernel, to ask for the state of
# widgets made before the page was there. A fresh kernel that has not imported ipywidgets yet has
# no such target and drops the comm; the manager's next message on it makes the kernel log "No
# such comm". No widget exists then, so there is nothing to restore and nothing the learner misses.
HARMLESS_KERNEL_LOG = re.compile(r"^No such comm: (\S+)\s*$")
CONTROL_TARGET = "jupyter.widget.control"


def stray_errors(sent: list[dict], iopub: dict[str, list[dict]], comms: dict[str, str]) -> list[str]:
    """Errors and stderr the kernel sent in answer to no cell (a widget callback's), as text,
    less the "No such comm" of the widget manager's own control comm (see HARMLESS_KERNEL_LOG)."""
    cells = {r["id"] for r in sent}
    found = []
    for parent, messages in iopub.items():
        if parent in cells:
            continue
        for m in messages:
            c = m["content"]
            if m["msg_type"] == "error":
                found.append(f"{c['ename']}: {c['evalue']}")
            elif m["msg_type"] == "stream" and c.get("name") == "stderr":
                lines = [line for line in c["text"].splitlines() if line.strip()]
                harmless = [HARMLESS_KERNEL_LOG.match(line) for line in lines]
                if not all(h and comms.get(h.group(1)) == CONTROL_TARGET for h in harmless):
                    found.append(c["text"])
    return found
