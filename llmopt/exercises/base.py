"""What every exercise is: a learner's function held against the engine's own implementation.

An `Exercise` runs its cases (inputs the engine's tests use, expected values computed by the
engine's real function) through the learner's function and stops at the first case that
differs; the `CheckResult` it returns is true only when every case matched, and its report
shows that first failing case: the inputs, what the engine gives, what the function gave.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Case:
    """One input the function is tried on. `call(fn)` runs the learner's function on it and
    returns what should equal `expected` (by `same(got, expected)`)."""

    inputs: dict
    expected: object
    call: Callable
    same: Callable | None = None
    note: str = ""   # what this case is about, named in the report when it fails


@dataclass
class CheckResult:
    """Pass or fail, and a report a learner can read. `bool(result)` is the verdict."""

    name: str
    passed: bool
    report: str
    answered: bool = True   # False: the function still raises NotImplementedError

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return self.report

    __repr__ = __str__


@dataclass
class Exercise:
    """A piece of the engine the learner writes.

    cases(): the cases the check runs, expected values from the engine's own code.
    solution: the reference answer (a real function with the learner's signature).
    live(fn): plugs a passing `fn` into the engine and runs it; returns a printable report.
    """

    name: str
    lesson: int
    title: str
    cases: Callable[[], Iterable[Case]]
    solution: Callable
    live: Callable[..., str] | None = None

    def check(self, fn: Callable) -> CheckResult:
        if not callable(fn):
            raise TypeError(f"{self.name}: check() needs the function you wrote, got {type(fn).__name__}")
        passed = 0
        for case in self.cases():
            try:
                got = case.call(fn)
            except NotImplementedError:
                return CheckResult(self.name, False, f"{self.name}: not implemented yet. Write the function "
                                   "in the cell above, run it, then run this cell.", answered=False)
            except Exception as e:  # the learner's bug, shown as the failing case
                return self._fail(case, passed, f"raised {type(e).__name__}: {e}{_where(e)}")
            try:
                right = (case.same or same)(got, case.expected)
            except Exception as e:  # a result of the wrong kind (a list for a tensor, a wrong shape)
                right = False
                got = f"{show(got)}  (cannot compare: {e})"
            if not right:
                return self._fail(case, passed, got)
            passed += 1
        return CheckResult(self.name, True, f"{self.name}: all {passed} cases match the engine's.")

    def run_live(self, fn: Callable, **kwargs) -> str:
        """Put `fn` into the engine and run it (only once `check(fn)` passes); `kwargs` go to
        the live run (lesson 08's: the `url` of a server already running)."""
        if self.live is None:
            raise ValueError(f"{self.name} has no live run")
        if not self.check(fn):
            raise ValueError(f"{self.name}: the check does not pass yet; run check(fn) for the first failing case")
        return self.live(fn, **kwargs)

    def _fail(self, case: Case, passed: int, got: str) -> CheckResult:
        lines = [f"{self.name}: case {passed + 1} differs from the engine" + (f" ({case.note})" if case.note else "")
                 + f"; {passed} case{'s' if passed != 1 else ''} before it matched.", "  inputs:"]
        lines += [f"    {k} = {show(v)}" for k, v in case.inputs.items()]
        lines += [f"  expected: {show(case.expected)}", f"  got:      {got if isinstance(got, str) else show(got)}"]
        if not isinstance(got, str):
            lines += first_difference(got, case.expected)
        return CheckResult(self.name, False, "\n".join(lines))


def same(got, expected) -> bool:
    """Equal values; tensors equal in shape and (to float32 rounding) in every element."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"a tensor is expected, got {type(got).__name__}")
        if got.shape != expected.shape:
            raise ValueError(f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        if expected.is_floating_point():
            return bool(torch.allclose(got.float(), expected.float(), rtol=1e-5, atol=1e-6, equal_nan=True))
        return bool(torch.equal(got, expected))
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(expected) and all(same(g, e) for g, e in zip(got, expected))
    return got == expected


def first_difference(got, expected) -> list[str]:
    """Where two equal-shaped tensors (or lists of them) first differ, as report lines."""
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(expected):
        for i, (g, e) in enumerate(zip(got, expected)):
            if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and g.shape == e.shape and not same(g, e):
                return [f"  item {i} differs first:"] + first_difference(g, e)
        return []
    if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape == expected.shape):
        return []
    g, e = got.detach().float(), expected.detach().float()
    bad = ~torch.isclose(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)
    if not bad.any():
        return []
    index = tuple(int(i) for i in bad.nonzero()[0])
    return [f"  first difference at index {list(index)}: expected {float(e[index]):.6g}, got {float(g[index]):.6g} "
            f"({int(bad.sum())} of {bad.numel()} elements differ)"]


def _where(e: Exception) -> str:
    """' (line N)' of the deepest frame in the learner's own code (a notebook cell), if any."""
    skip = (sys.prefix, sys.base_prefix, str(Path(__file__).parents[1]))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    return f" (line {frames[-1].lineno} of your function)" if frames else ""


def show(v, limit: int = 8) -> str:
    """A short readable form: small tensors in full, big ones by shape and first values."""
    if isinstance(v, torch.Tensor):
        flat = v.detach().flatten().tolist()
        head = ", ".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in flat[:limit])
        more = ", ..." if len(flat) > limit else ""
        return f"tensor{list(v.shape)} {v.dtype}: [{head}{more}]"
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return "[" + ", ".join(show(x, limit) for x in v) + "]"
    if isinstance(v, (list, tuple)) and len(v) > 2 * limit:
        return f"{type(v).__name__} of {len(v)}: {show(list(v[:limit]))[:-1]}, ...]"
    text = repr(v)
    return text if len(text) <= 300 else text[:300] + " ..."
