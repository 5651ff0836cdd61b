"""Lesson 08's exercise: a server-sent events (SSE) parser, the client's half of a streamed completion.

A streamed response is text: events separated by a blank line, each made of `field: value`
lines. The `data` lines carry the payload (several in one event are joined with a newline; one
space after the colon is dropped), lines starting with `:` are comments (keep-alives), other
fields (`event`, `id`, `retry`) are not the payload, and OpenAI's streams end with `data: [DONE]`.
The check feeds the learner's parser streams the engine's server encodes (its own `_sse` and
chunk builders) plus what proxies do to them; the live run parses a real stream from the server.
"""

from __future__ import annotations

import json

from llmopt.exercises.base import Case, Exercise
from llmopt.server.protocol import chat_chunk, completion_chunk, usage, usage_chunk


def parse_sse_solution(stream: str) -> list[dict]:
    """The JSON payload of every event in `stream`, in order, up to `data: [DONE]`."""
    events, data = [], []
    for line in stream.replace("\r\n", "\n").replace("\r", "\n").split("\n") + [""]:
        if line == "":                       # a blank line ends an event
            if data:
                payload = "\n".join(data)
                if payload == "[DONE]":
                    break
                events.append(json.loads(payload))
            data = []
        elif line.startswith(":"):           # a comment: a keep-alive, nothing to deliver
            continue
        else:
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    return events


def _completion(texts: list[str], reason: str = "length") -> list[dict]:
    chunks = [completion_chunk("cmpl-1", "tiny", 0, t, None) for t in texts]
    return chunks + [completion_chunk("cmpl-1", "tiny", 0, "", reason)]


def _chat(texts: list[str]) -> list[dict]:
    chunks = [chat_chunk("chat-1", "tiny", 0, {"role": "assistant", "content": ""}, None)]
    chunks += [chat_chunk("chat-1", "tiny", 0, {"content": t}, None) for t in texts]
    return chunks + [chat_chunk("chat-1", "tiny", 0, {}, "stop"),
                     usage_chunk("chat-1", "tiny", 0, True, usage(5, len(texts)))]


def _sse(data) -> str:
    from llmopt.server.api_server import (
        _sse,  # the server's own encoder (imported late: it loads the web stack)
    )

    return _sse(data)


def _encode(events: list[dict]) -> str:
    return "".join(_sse(e) for e in events) + _sse("[DONE]")


def _streams() -> list[tuple[str, str, list[dict]]]:
    a = _completion(["def", " add", "(a, b):"])
    b = _chat(["Hello", "! I", " can help."])
    tricky = _completion(["line one\nline two", " {\"braces\": 1}", " data: [DONE]"])  # payloads that look like syntax
    one = [completion_chunk("cmpl-2", "tiny", 0, "x", "stop")]
    return [
        ("a completion, as the server sends it", _encode(a), a),
        ("a chat completion with a usage chunk", _encode(b), b),
        ("text with newlines, braces and 'data: [DONE]' inside the JSON", _encode(tricky), tricky),
        ("keep-alive comments between events",
         ": ping\n\n" + _encode(a).replace("\n\ndata", "\n\n: keep-alive\n\ndata"), a),
        ("CRLF line endings (through a proxy)", _encode(b).replace("\n", "\r\n"), b),
        ("'data:' without the space", _encode(a).replace("data: ", "data:"), a),
        ("one event's JSON over two data lines", "data: " + json.dumps(one[0]).replace(", ", ",\ndata: ", 1)
         + "\n\n" + _sse("[DONE]"), one),
        ("event and id fields beside the data", "event: message\nid: 1\n" + _encode(one), one),
        ("nothing after [DONE] is delivered", _encode(a) + _sse(one[0]), a),
        ("a stream whose last event has no blank line after it", _encode(one)[:-2], one),
    ]


def cases():
    for note, stream, expected in _streams():
        yield Case({"stream": stream}, expected, lambda fn, s=stream: fn(s), note=note)


def live(fn, url: str | None = None) -> str:
    """Stream a completion from an llmopt server (the one at `url`, or a `tiny` one started for
    this), parse the response body with `fn`, and compare its text with the same request unstreamed."""
    import httpx

    from llmopt.server.process import ServerProcess

    server = None if url else ServerProcess(["--model", "tiny", "--device", "cpu"], threads=1).start()
    url = url or server.url
    try:
        body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0.0}
        streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60).text
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        if server is not None:
            server.stop()
    events = fn(streamed)
    text = "".join(e["choices"][0].get("text") or "" for e in events if e.get("choices"))
    return (f"{len(streamed):,} bytes of stream -> {len(events)} events; their text "
            + ("equals" if text == whole else "DIFFERS from") + f" the unstreamed completion's:\n{text!r}")


EXERCISE = Exercise("sse_parser", 8, "parse a server-sent event stream into its JSON chunks", cases,
                    parse_sse_solution, live)
