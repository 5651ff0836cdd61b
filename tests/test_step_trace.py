"""One greedy decode step of `tiny` with enforce_eager=True, followed as a learner would follow it.

`sys.setprofile` records every llmopt function the step calls and every call into compiled code
of llmopt's own (the C++ extension; a Triton kernel is a Python call into llmopt.kernels, counted
as a function of that file). A comprehension counts as part of the function it sits in, as
Python 3.12 compiles it. The eager step is the reference the fast backends are tested against,
so it has to read top to bottom: few functions, few files, none long, nothing compiled.

Run-time choices are the branches a step evaluates that select an implementation (backend,
attention kernel, matmul kernel, sampler tier). Each is marked in the code with a comment
`# step choice: <what it selects>` on the line that decides; the trace lists the marked lines
the step executed. `python tests/test_step_trace.py` prints the whole walk.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmopt"
CHOICE = re.compile(r"#\s*step choice:\s*(.+)$")
MAX_FUNCTIONS, MAX_FILES, MAX_LINES, MAX_CHOICES = 40, 12, 60, 3


@dataclass
class StepTrace:
    calls: Counter = field(default_factory=Counter)       # (file, function, first line) -> calls
    lengths: dict = field(default_factory=dict)           # (file, function, first line) -> lines
    compiled: Counter = field(default_factory=Counter)    # compiled llmopt callables -> calls
    choices: dict = field(default_factory=dict)           # (file, line) -> what the marked line selects

    @property
    def files(self) -> set[str]:
        return {f for f, _, _ in self.calls}


def _function_key(code) -> tuple[str, str, int] | None:
    path = Path(code.co_filename)
    if PACKAGE not in path.parents:
        return None
    name = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
    if name.split(".")[-1].startswith("<") and name.split(".")[-1] != "<lambda>":
        return None  # a comprehension or generator expression: part of its function
    return str(path.relative_to(ROOT)), name, code.co_firstlineno


def _length(code) -> int:
    lines = [n for _, _, n in code.co_lines() if n is not None]
    return max(lines) - code.co_firstlineno + 1 if lines else 1


def _marked_lines() -> dict[tuple[str, int], str]:
    marks = {}
    for f in PACKAGE.rglob("*.py"):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            m = CHOICE.search(line)
            if m:
                marks[(str(f.relative_to(ROOT)), i)] = m.group(1).strip()
    return marks


def trace_decode_step(engine) -> StepTrace:
    """Run one `engine.step()` (a decode step) under the profiler and return what it called."""
    trace, marks = StepTrace(), _marked_lines()

    def profile(frame, event, arg):
        if event == "call":
            key = _function_key(frame.f_code)
            if key is not None:
                trace.calls[key] += 1
                trace.lengths[key] = _length(frame.f_code)
        elif event == "c_call":
            module = getattr(arg, "__module__", None) or ""
            owner = type(getattr(arg, "__self__", None)).__module__ or ""
            if module.startswith("llmopt") or owner.startswith("llmopt"):
                trace.compiled[f"{module or owner}.{getattr(arg, '__name__', '?')}"] += 1

    def lines(frame, event, arg):
        if event == "line":
            where = (str(Path(frame.f_code.co_filename).relative_to(ROOT)), frame.f_lineno)
            if where in marks:
                trace.choices[where] = marks[where]
        return lines

    def local_tracer(frame, event, arg):
        return lines if PACKAGE in Path(frame.f_code.co_filename).parents else None

    sys.setprofile(profile)
    sys.settrace(local_tracer)
    try:
        engine.step()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return trace


def eager_decode_trace() -> tuple[object, StepTrace]:
    from llmopt import LLM, SamplingParams

    llm = LLM("tiny", enforce_eager=True, dtype="float32")
    engine = llm.llm_engine
    engine.add_request("r", "def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt
    engine.step()  # a first decode: anything built once per engine is built by now
    seq = engine.requests["r"]
    assert seq.num_computed_tokens == seq.num_tokens - 1, "the traced step must be a decode"
    return engine, trace_decode_step(engine)


def report(trace: StepTrace) -> str:
    per_file = Counter(f for f, _, _ in trace.calls)
    out = [f"{len(trace.calls)} llmopt functions in {len(trace.files)} files; "
           f"longest {max(trace.lengths.values())} lines; compiled calls {dict(trace.compiled) or 'none'}; "
           f"{len(trace.choices)} run-time choices"]
    for f in sorted(per_file):
        names = sorted((line, name, trace.lengths[(f, name, line)]) for ff, name, line in trace.calls if ff == f)
        out.append(f"  {f}: " + ", ".join(f"{name} ({n} lines)" for _, name, n in names))
    out += [f"  choice {f}:{line}: {what}" for (f, line), what in sorted(trace.choices.items())]
    return "\n".join(out)


def test_an_eager_decode_step_reads_top_to_bottom():
    torch.set_num_threads(1)
    engine, trace = eager_decode_trace()
    print(report(trace))
    assert engine.decode_path == "eager (enforce_eager=True)"
    assert not trace.compiled, f"the eager step called compiled code: {dict(trace.compiled)}"
    assert not any(f.startswith("llmopt/kernels") for f in trace.files), "the eager step ran a kernel's file"
    assert len(trace.calls) <= MAX_FUNCTIONS, report(trace)
    assert len(trace.files) <= MAX_FILES, report(trace)
    long = {k: n for k, n in trace.lengths.items() if n > MAX_LINES}
    assert not long, f"functions over {MAX_LINES} lines: {long}"
    assert len(trace.choices) <= MAX_CHOICES, report(trace)


if __name__ == "__main__":
    print(report(eager_decode_trace()[1]))
