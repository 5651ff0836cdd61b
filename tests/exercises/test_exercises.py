"""The lessons' code exercises: every check passes its solution and fails a do-nothing answer and
an almost-right one (each a real mistake: an off-by-one, a missing clamp, a forgotten chain).

The checks' expected values come from the engine's own functions, so these tests also hold each
solution to the engine. One live run (the slot mapping, on `tiny`) shows that plugging a function
into the engine really changes what it computes. Lessons 09 to 15's exercises each have a file of
their own beside this one (test_exercise_*.py: their almost-right answers, their live runs); the
checks every exercise shares run here over all of them.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

import test_exercise_bitmask
import test_exercise_breaker
import test_exercise_int_kv
import test_exercise_moe_route
import test_exercise_q4_1
import test_exercise_tp_shard
import test_exercise_verdict
from llmopt.engine.block_manager import hash_block
from llmopt.exercises import (
    EXERCISES,
    fp8,
    kv_cache,
    paging,
    prefix,
    rtn,
    scheduling,
    spec,
    sse,
)


def not_implemented(*args, **kwargs):
    raise NotImplementedError("replace this line with your answer")


def store_kv_off_by_one(k_cache, v_cache, k, v, slots, context_lens, query_lens):
    start = 0
    for slot, c, n in zip(slots, context_lens, query_lens):  # writes one position too far
        k_cache[slot, :, c + 1:c + 1 + n] = k[start:start + n].transpose(0, 1)[:, :k_cache.shape[2] - c - 1]
        v_cache[slot, :, c + 1:c + 1 + n] = v[start:start + n].transpose(0, 1)[:, :v_cache.shape[2] - c - 1]
        start += n


def slots_without_block_size(block_table, positions, block_size):
    return [block_table[p // block_size] + p % block_size for p in positions]  # forgot * block_size


def schedule_passing_the_head(running, waiting, token_budget, max_num_seqs, chunked_prefill=True):
    """Right except that without chunking a prompt too big to fit lets later ones pass it."""
    granted, budget, seqs = [], token_budget, len(running)
    for need in running:
        granted.append(min(need, budget))
        budget -= granted[-1]
    for prompt in waiting:
        n = 0
        if budget > 0 and seqs < max_num_seqs:
            n = prompt if prompt <= budget else (budget if chunked_prefill else 0)
        granted.append(n)
        budget, seqs = budget - n, seqs + (n > 0)
    return granted


def hashes_not_chained(token_ids, block_size):
    return [hash_block(None, tuple(token_ids[i:i + block_size]))
            for i in range(0, len(token_ids) - block_size + 1, block_size)]


def resample_from_p(p, q, x, u):
    return None if q[x] > 0 and u < min(1.0, float(p[x] / q[x])) else p  # the residual forgotten


def rtn_zero_off_grid(w, bits, group_size):
    """Right except that min and max are not stretched to hold 0 (one-signed groups)."""
    out, k = w.shape
    g = k if group_size == -1 else group_size
    groups = w.float().reshape(out, k // g, g)
    maxq = 2 ** bits - 1
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((hi - lo) / maxq).half().float()
    scale = torch.where(scale == 0, 1.0, scale)
    zero = torch.round(-lo / scale)
    return (scale * (torch.clamp(torch.round(groups / scale) + zero, 0, maxq) - zero)).reshape(out, k)


def e4m3_without_saturation(x):
    a = x.float().abs()
    _, exponent = torch.frexp(a)
    step = torch.exp2((exponent - 1).clamp(min=-6).float() - 3)
    return torch.copysign(torch.round(a / step) * step, x.float())  # 464 becomes 480: past the format


def sse_without_comments(stream):
    events = []
    for block in stream.replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line.partition(":")[2].lstrip(" ") for line in block.split("\n") if line)
        if data == "[DONE]":
            break
        if data:
            events.append(json.loads(data))
    return events


ALMOST_RIGHT = {
    "contiguous_kv_store": store_kv_off_by_one,
    "slot_mapping": slots_without_block_size,
    "token_budget_schedule": schedule_passing_the_head,
    "chained_block_hashes": hashes_not_chained,
    "speculative_accept_resample": resample_from_p,
    "groupwise_rtn": rtn_zero_off_grid,
    "e4m3_rounding": e4m3_without_saturation,
    "sse_parser": sse_without_comments,
}
for _lesson in (test_exercise_tp_shard, test_exercise_moe_route, test_exercise_breaker, test_exercise_q4_1,
                test_exercise_bitmask, test_exercise_int_kv, test_exercise_verdict):
    ALMOST_RIGHT.update(_lesson.ALMOST_RIGHT)


def test_one_exercise_per_lesson_01_to_15():
    assert sorted(e.lesson for e in EXERCISES.values()) == list(range(1, 16))
    assert set(ALMOST_RIGHT) == set(EXERCISES)
    modules = [kv_cache, paging, scheduling, prefix, spec, rtn, fp8, sse]
    assert [m.EXERCISE for m in modules] == list(EXERCISES.values())[:8]


@pytest.mark.parametrize("name", list(EXERCISES))
def test_solution_passes(name):
    ex = EXERCISES[name]
    result = ex.check(ex.solution)
    assert result, result.report
    assert result.report.endswith("match the engine's.")


@pytest.mark.parametrize("name", list(EXERCISES))
def test_unanswered_is_reported_not_raised(name):
    result = EXERCISES[name].check(not_implemented)
    assert not result and not result.answered
    assert "not implemented yet" in result.report


@pytest.mark.parametrize("name", list(EXERCISES))
def test_do_nothing_fails(name):
    result = EXERCISES[name].check(lambda *args, **kwargs: None)
    assert not result and result.answered
    assert "case 1 differs" in result.report and "expected:" in result.report


@pytest.mark.parametrize("name", list(EXERCISES))
def test_almost_right_fails_with_its_case(name):
    result = EXERCISES[name].check(ALMOST_RIGHT[name])
    assert not result and result.answered
    assert "differs from the engine" in result.report and "inputs:" in result.report and "got:" in result.report


def test_report_shows_the_failing_inputs():
    result = EXERCISES["slot_mapping"].check(slots_without_block_size)
    assert "block_table = [3]" in result.report and "expected: [14]" in result.report
    assert "got:      [5]" in result.report


def test_check_needs_a_function():
    with pytest.raises(TypeError, match="needs the function"):
        EXERCISES["slot_mapping"].check(42)
    with pytest.raises(ValueError, match="does not pass"):
        EXERCISES["slot_mapping"].run_live(slots_without_block_size)


def test_engine_runs_the_plugged_in_slot_mapping():
    ok = EXERCISES["slot_mapping"].live(paging.slots_of_solution)
    assert ok.endswith("generates its own text") and "DIFFERENT" not in ok
    # a wrong mapping (every token of a block at the block's first slot) changes what it generates
    wrong = EXERCISES["slot_mapping"].live(lambda t, ps, b: [t[p // b] * b for p in ps])
    assert "DIFFERENT" in wrong


LESSON_DIR = Path(__file__).resolve().parents[2] / "lessons"


@pytest.mark.parametrize("name", list(EXERCISES))
def test_lesson_opens_its_exercise_with_the_solution_collapsed(name):
    """The lesson has a stub, a check cell, and a collapsed solution that is the registry's own
    (so the two cannot drift apart); its stored output is the unanswered state."""
    ex = EXERCISES[name]
    lesson = next(LESSON_DIR.glob(f"{ex.lesson:02d}_*.ipynb"))
    cells = json.loads(lesson.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    at = next(i for i, t in enumerate(text) if f'EXERCISES["{name}"].check(' in t)
    fn = text[at].split(".check(")[1].split(")")[0]
    assert f"def {fn}(" in text[at - 1] and "NotImplementedError" in text[at - 1]
    stored = "".join("".join(o.get("text", "")) for o in cells[at]["outputs"])
    assert stored.strip() == str(ex.check(not_implemented))
    solution = text[at + 1]
    assert solution.startswith("<details>") and "</details>" in solution
    assert inspect.getsource(ex.solution).replace(ex.solution.__name__, fn) in solution
