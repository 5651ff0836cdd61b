"""nbval's check of a lesson, made on the run the browser suite does instead of on a second run.

Running every lesson twice (once by nbval, once in JupyterLab) would double the lessons' share of
CI time, so when the browser suite runs a lesson, nbval's items for that notebook are deselected
and their check is made here, on the kernel messages of the browser's run: the page records
every execute request it sends and every iopub message its kernel answers with; for each code
cell the outputs are gathered from those messages exactly as nbval's `IPyNbCell.runtest` gathers
them from its own kernel (display_data, execute_result, stream and error, then streams coalesced),
and compared with the stored ones by nbval's own items: its cell tags, sanitize file and
`compare_outputs`. What nbval would report, this reports, cell by cell. The messages are
recorded by kernel_messages.py.
"""

from __future__ import annotations

import re

from nbformat import NotebookNode
from nbval.plugin import IPyNbCell, coalesce_streams

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def outputs_from_messages(messages: list[dict]) -> list[NotebookNode]:
    """A cell's outputs from its iopub messages, built as nbval's runtest builds them."""
    outs = []
    for msg in messages:
        kind, content = msg["msg_type"], msg["content"]
        out = NotebookNode(output_type=kind)
        if kind in ("display_data", "execute_result"):
            out["metadata"] = content["metadata"]
            out["data"] = content["data"]
            if kind == "execute_result":
                out.execution_count = content["execution_count"]
        elif kind == "stream":
            out.name, out.text = content["name"], content["text"]
        elif kind == "error":
            out["ename"], out["evalue"], out["traceback"] = content["ename"], content["evalue"], content["traceback"]
        outs.append(out)
    return coalesce_streams(outs)


def check(items: list[IPyNbCell], sent: list[dict], iopub: dict[str, list[dict]]) -> list[str]:
    """nbval's verdict on each of a notebook's code cells (its items, in order), from the browser's run."""
    problems = []
    if items:
        items[0].parent.setup_sanitize_files()  # what nbval's setup does, less starting a kernel
    if len(sent) < len(items):
        problems.append(f"nbval: the browser run executed {len(sent)} of {len(items)} code cells")
    for item, request in zip(items, sent):
        where = f"nbval {item.name}"
        if request["code"] != item.cell.source:
            problems.append(f"{where}: the browser ran other code than the notebook holds")
            continue
        if item.options["skip"]:
            continue
        outs = outputs_from_messages(iopub.get(request["id"], []))
        errors = [o for o in outs if o.output_type == "error"]
        if errors and not item.options["check_exception"]:
            problems.append(f"{where}: Cell execution caused an exception: {errors[0]['ename']}: "
                            f"{errors[0]['evalue'][:300]}")
            continue
        unrun = item.cell.execution_count is None
        if unrun and item.cell.outputs:
            problems.append(f"{where}: Unrun reference cell has outputs")
        elif item.options["check"] and not unrun:
            if not item.compare_outputs(outs, coalesce_streams(item.cell.outputs)):
                got = "; ".join(f"{o.output_type}: {str(o.get('text', o.get('data', '')))[:300]!r}" for o in outs)
                problems.append(f"{where}: Cell outputs differ\n" + ANSI.sub("", "\n".join(
                    str(line) for line in item.comparison_traceback)) + f"\nthe browser's run gave: {got or 'nothing'}")
    return problems
