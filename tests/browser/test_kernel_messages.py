"""The filter that tells a widget callback's error from the widget manager's own harmless log
lines: a unit test on recorded messages, without a browser."""

from __future__ import annotations

from kernel_messages import stray_errors

SENT = [{"id": "cell-1", "code": "1 + 1"}]


def stderr(text: str) -> dict:
    return {"msg_type": "stream", "content": {"name": "stderr", "text": text}}


def test_control_comm_lines_are_harmless_however_slow_the_kernel_was():
    # fast kernel: the page's control comm was recorded when it opened
    assert stray_errors(SENT, {"x": [stderr("No such comm: c1\n")]}, {"c1": "jupyter.widget.control"}) == []
    # slow kernel (lesson 12 in CI): the comm opened before the recorder started
    slow = {"x": [stderr("No such comm target registered: jupyter.widget.control\n")],
            "y": [stderr("No such comm: ed42\n")]}
    assert stray_errors(SENT, slow, {}) == []
    # slower still (lesson 08 in CI): the kernel's "no target" line also came before the recorder
    assert stray_errors(SENT, {"y": [stderr("No such comm: ed43\n")]}, {}) == []


def test_a_widget_comm_or_a_callback_error_is_still_found():
    comms = {"w1": "jupyter.widget"}
    lost_widget = {"x": [stderr("No such comm target registered: jupyter.widget.control\n")],
                   "y": [stderr("No such comm: w1\n")]}
    assert stray_errors(SENT, lost_widget, comms) == ["No such comm: w1\n"]
    # a widget the kernel opened on record and later lost, with no control-comm line at all
    assert stray_errors(SENT, {"y": [stderr("No such comm: w1\n")]}, comms) == ["No such comm: w1\n"]
    callback = {"x": [{"msg_type": "error", "content": {"ename": "ValueError", "evalue": "bad k"}},
                      stderr("Traceback ...\n")]}
    assert stray_errors(SENT, callback, {}) == ["ValueError: bad k", "Traceback ...\n"]
    # a cell's own stderr is the cell's business (nbval compares it), not a stray
    assert stray_errors(SENT, {"cell-1": [stderr("warning\n")]}, {}) == []
