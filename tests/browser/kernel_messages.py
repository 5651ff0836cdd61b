"""What the page's kernel connection sends and receives, recorded in the page while a notebook runs.

JupyterLab's kernel connection signals every message (`anyMessage`); the recorder keeps each
execute request (its id and code) and each output message on iopub, under the id of the request
that caused it. Outputs whose request is no cell's execute request came from a widget callback:
JupyterLab shows those only in its log console, so a callback that raises would go unseen in
the notebook; `stray_errors` finds them.
"""

from __future__ import annotations

from playwright.sync_api import Page

import lab_page

OUTPUT_TYPES = ("display_data", "execute_result", "stream", "error")

RECORD = """() => {
  const k = %s;
  window.__sent = []; window.__iopub = {};
  k.anyMessage.connect((_, args) => {
    const m = args.msg;
    if (args.direction === 'send' && m.header.msg_type === 'execute_request') {
      window.__sent.push({id: m.header.msg_id, code: m.content.code});
    } else if (args.direction === 'recv' && m.channel === 'iopub' && m.parent_header && m.parent_header.msg_id
               && %s.includes(m.header.msg_type)) {
      (window.__iopub[m.parent_header.msg_id] = window.__iopub[m.parent_header.msg_id] || [])
        .push({msg_type: m.header.msg_type, content: m.content});
    }
  });
}""" % (lab_page.KERNEL, list(OUTPUT_TYPES))


def start_recording(page: Page) -> None:
    page.evaluate(RECORD)


def recorded(page: Page) -> tuple[list[dict], dict[str, list[dict]]]:
    """(execute requests in the order sent, {request id: its iopub output messages})."""
    return page.evaluate("() => [window.__sent, window.__iopub]")


def stray_errors(sent: list[dict], iopub: dict[str, list[dict]]) -> list[str]:
    """Errors and stderr the kernel sent in answer to no cell (a widget callback's), as text."""
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
                found.append(c["text"])
    return found
