"""The lesson views of the engine (block tables, timelines, memory), built from small real runs.

Each view is checked against what the engine itself says: the block ids in its trace, the ref
counts of its block manager, its preemption counter, the tokens it generated.
"""

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from llmopt import LLM, SamplingParams  # noqa: E402
from llmopt.viz.block_table import (block_states, block_table_figure, block_table_rows,  # noqa: E402
                                    block_table_text, block_table_widget, pool_state, tokens_in_cache)
from llmopt.viz.memory import (block_size_figure, block_size_rows, block_size_text,  # noqa: E402
                               block_size_widget, reservation_figure, reservation_rows,
                               reservation_summary, reservation_text)
from llmopt.viz import setup_notebook  # noqa: E402
import traced  # noqa: E402  (tests/viz/traced.py)
from llmopt.viz.timeline import (latency_figure, latency_rows, request_states, run_traced,  # noqa: E402
                                 scheduler_widget, segments, static_batching, step_summary,
                                 step_tokens_figure, timeline_figure, timeline_text)

BLOCK = 16
setup_notebook()  # figures render as plotly's JSON mimetype, as in the lessons


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def make_llm(**knobs) -> LLM:
    return traced.make_llm(**{"block_size": BLOCK, **knobs})


def ids(start: int, n: int) -> dict:
    return {"prompt_token_ids": [1] + list(range(start, start + n - 1))}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


PROMPTS = [ids(100, 10), ids(300, 26), ids(500, 40), ids(700, 8), ids(900, 20)]
MAX_TOKENS = [12, 6, 20, 9, 7]
PARAMS = [greedy(n) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def run():
    return run_traced(make_llm(max_num_seqs=3), PROMPTS, PARAMS, arrival_steps=[0, 0, 1, 2, 6])


@pytest.fixture(scope="module")
def static():
    return static_batching(make_llm(max_num_seqs=3), PROMPTS, PARAMS, batch_size=2)


# -- run_traced ------------------------------------------------------------------------------------
def test_run_traced_records_every_step_and_token(run):
    assert run.request_ids == ["r0", "r1", "r2", "r3", "r4"]
    assert [len(o.outputs[0].token_ids) for o in run.outputs] == MAX_TOKENS
    assert [len(run.token_steps[r]) for r in run.request_ids] == MAX_TOKENS
    assert [e["step"] for e in run.trace] == list(range(run.num_steps))  # a fresh engine
    assert all("pool" in e and "start_time" in e for e in run.trace)
    for rid, arrival in run.arrival_steps.items():
        assert run.token_steps[rid][0] >= arrival
    # greedy tokens do not depend on how requests were batched
    alone = make_llm().generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in run.outputs]


def test_run_traced_rejects_bad_use():
    with pytest.raises(ValueError, match="enable_trace"):
        run_traced(make_llm(enable_trace=False), PROMPTS[:1], PARAMS[0])
    with pytest.raises(ValueError, match="one sampling params"):
        run_traced(make_llm(), PROMPTS, PARAMS, arrival_steps=[0])
    stuck = make_llm(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):  # rejected up front
        run_traced(stuck, [ids(100, 40)], greedy(2))


# -- block tables ----------------------------------------------------------------------------------
def test_block_table_text_lists_the_engines_block_ids(run):
    for step, entry in enumerate(run.trace):
        text = block_table_text(run.trace, step, BLOCK)
        assert text.startswith(f"step {step} of {run.num_steps - 1}")
        for rid, table in entry["block_tables"].items():
            line = next(line for line in text.splitlines() if line.startswith(rid + " "))
            assert "[" + ", ".join(map(str, table)) + "]" in line
        for rid in entry["finished"]:
            assert "finished" in text.splitlines()[0] and rid in text.splitlines()[0]
    assert "(no request holds blocks)" in block_table_text(run.trace, run.num_steps - 1)


def test_block_table_rows_tokens_fit_their_blocks(run):
    for step in range(run.num_steps):
        for row in block_table_rows(run.trace, step, BLOCK):
            assert (row["blocks"] - 1) * BLOCK < row["tokens"] <= row["blocks"] * BLOCK
            assert row["empty slots"] == row["blocks"] * BLOCK - row["tokens"]
    # r0 still holds blocks until the step that samples its last token; by then its 10 prompt
    # tokens and all but its last two generated tokens are in the cache (a token's KV is
    # written by the step after the one that sampled it)
    last_r0 = max(i for i, e in enumerate(run.trace) if "r0" in e["block_tables"])
    assert tokens_in_cache(run.trace, last_r0)["r0"] == 10 + MAX_TOKENS[0] - 2
    # the trace's own count agrees with the sum over running requests (nothing shared here)
    for step, entry in enumerate(run.trace):
        assert sum(tokens_in_cache(run.trace, step).values()) == entry["tokens_stored"]


def test_block_states_follow_the_pool_snapshot(run):
    for entry in run.trace:
        states = block_states(entry)
        assert len(states) == entry["num_blocks"] == 32
        assert [s["ref_cnt"] for s in states] == entry["pool"]["ref_cnt"]
        assert sum(s["state"] in ("used", "shared") for s in states) == entry["blocks_used"]


def test_block_table_figure_shows_tables_and_pool(run):
    step = 5
    entry = run.trace[step]
    fig = block_table_figure(run.trace, step)
    left = [t for t in fig.data if t.xaxis == "x"]
    assert {t.name: [int(b) for b in t.text] for t in left} == entry["block_tables"]
    right = [t for t in fig.data if t.xaxis == "x2"]
    cells = sorted(int(label.split("<br>")[0]) for t in right for label in t.text)
    assert cells == list(range(entry["num_blocks"]))
    assert "free" in {t.name for t in right}


def test_block_table_widget_redraws_on_the_slider(run):
    widget = block_table_widget(run.trace, block_size=BLOCK, step=0)
    assert repr(widget).startswith("[interactive widget: block tables")
    slider, out = widget.children[0].children[1], widget.children[1]
    assert slider.max == run.num_steps - 1
    slider.value = 4
    figure, text = out.outputs
    assert "application/vnd.plotly.v1+json" in figure["data"]
    assert text["text"].startswith("step 4 of")


def test_shared_prefix_blocks_appear_in_several_tables():
    llm = make_llm(enable_prefix_caching=True)
    prefix = list(range(100, 148))  # 48 tokens: 3 full blocks
    prompts = [{"prompt_token_ids": prefix + [600 + 10 * i + j for j in range(5)]} for i in range(3)]
    r = run_traced(llm, prompts, greedy(8), arrival_steps=[0, 1, 2])
    assert [r.seqs[rid].num_cached_tokens for rid in r.request_ids] == [0, 48, 48]
    step = 3  # all three running
    tables = r.trace[step]["block_tables"]
    assert len(tables) == 3
    shared = tables["r0"][:3]
    assert all(t[:3] == shared for t in tables.values())
    states = {s["block"]: s for s in block_states(r.trace[step])}
    assert all(states[b]["state"] == "shared" and states[b]["ref_cnt"] == 3 for b in shared)
    text = block_table_text(r.trace, step, BLOCK)
    assert "[" + ", ".join(f"{b}(3)" for b in shared) in text
    assert "3 shared" in text
    # after the end the prefix blocks are free but still cached, evicted in free-queue order
    last = r.trace[-1]
    assert set(shared) <= set(last["pool"]["cached"])
    assert "free blocks holding a cached prefix, in eviction order" in block_table_text(r.trace, r.num_steps - 1)
    assert sum(s["state"] == "cached" for s in block_states(last)) == len(last["pool"]["cached"])
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] == 96


def test_pool_state_matches_the_block_manager():
    llm = make_llm(num_kv_blocks=8, enable_prefix_caching=True)
    run_traced(llm, [ids(100, 40)], greedy(2))
    state = pool_state(llm.llm_engine.block_manager)
    assert state["ref_cnt"] == [0] * 8
    assert state["cached"] == [0, 1]          # 41 tokens computed: two full blocks
    assert state["free_queue"] == [3, 4, 5, 6, 7, 2, 1, 0]  # tail freed first, evicted first


# -- timelines ---------------------------------------------------------------------------------------
def test_static_batching_runs_one_batch_at_a_time(static):
    # each batch prefills in one step, then runs as long as its longest request
    assert static.num_steps == 12 + 20 + 7
    states = request_states(static)
    assert states["r2"][:12] == ["waiting"] * 12 and states["r2"][12] == "prefill"
    assert all(static.arrival_steps[r] == 0 for r in static.request_ids)
    row = step_summary(static, batch_slots=2)
    assert row["idle slot-steps"] == 2 * static.num_steps - sum(MAX_TOKENS)


def test_timeline_text_and_states(run, static):
    states = request_states(run)
    for rid, n in zip(run.request_ids, MAX_TOKENS):
        active = [s for s in states[rid] if s in ("prefill", "decode")]
        assert active == ["prefill"] + ["decode"] * (n - 1)
        assert states[rid][:run.arrival_steps[rid]] == [None] * run.arrival_steps[rid]
    text = timeline_text(run)
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("r")}
    assert lines["r4"][len("step  "):].startswith(" " * 6 + ".")  # arrives at step 6 and waits
    assert lines["r0"].count("d") == MAX_TOKENS[0] - 1
    assert text.splitlines()[0].split() == ["step", "0", "10", "20"]  # 21 steps
    assert step_summary(run)["steps"] < static.num_steps  # continuous batching needs fewer steps
    wide = timeline_text(static, width=20)
    assert wide.count("step") == -(-static.num_steps // 20)


def test_timeline_shows_preemption_and_recompute():
    llm = make_llm(num_kv_blocks=6, max_num_seqs=4)
    r = run_traced(llm, [ids(100 + 100 * i, 20) for i in range(3)], greedy(40))
    states = request_states(r)
    seen = {s for row in states.values() for s in row}
    assert {"preempted", "recompute"} <= seen
    assert step_summary(r)["preemptions"] == llm.get_metrics()["num_preemptions"] > 0
    assert "x" in timeline_text(r) and "R" in timeline_text(r)
    assert any(s["state"] == "preempted" for s in segments(r))


def test_timeline_figure_bars_cover_each_request(run):
    fig = timeline_figure(run)
    assert {t.name for t in fig.data} <= {"waiting", "prefill", "decode", "preempted", "recompute"}
    steps = {}
    for t in fig.data:
        for rid, length in zip(t.y, t.x):
            steps[rid] = steps.get(rid, 0) + length
    states = request_states(run)
    assert steps == {rid: sum(s is not None for s in states[rid]) for rid in run.request_ids}
    timed = timeline_figure(run, x="time")
    assert all(length > 0 for t in timed.data for length in t.x)
    with pytest.raises(ValueError):
        timeline_figure(run, x="tokens")


def test_latency_and_step_token_views(run, static):
    rows = latency_rows({"continuous": run, "static": static})
    assert [r["run"] for r in rows] == ["continuous", "static"]
    assert all(r["TTFT p50 ms"] > 0 and r["tokens/s"] > 0 for r in rows)
    assert len(latency_figure({"continuous": run, "static": static}).data) == 4
    fig = step_tokens_figure({"run": run})
    prefill = next(t for t in fig.data if t.name == "prefill")
    assert sum(prefill.y) == sum(e["num_prefill_tokens"] for e in run.trace) == 10 + 26 + 40 + 8 + 20


def test_scheduler_widget_reruns_the_workload():
    made = []

    def factory(**knobs):
        made.append(knobs)
        return make_llm(**knobs)

    widget = scheduler_widget(factory, PROMPTS, PARAMS, max_num_seqs=2, max_num_batched_tokens=64)
    assert made[-1] == {"max_num_seqs": 2, "max_num_batched_tokens": 64, "enable_chunked_prefill": True}
    seqs_slider = widget.children[0].children[0].children[0]
    out = widget.children[1]
    seqs_slider.value = 5
    assert made[-1]["max_num_seqs"] == 5
    figure, text = out.outputs
    assert "max_num_seqs=5" in figure["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"]
    assert "steps" in text["text"]
    chunked = widget.children[0].children[1].children[0]
    budget = widget.children[0].children[0].children[1]
    budget.value = 16
    chunked.value = False  # a 40-token prompt can never fit a 16-token step
    assert "enable_chunked_prefill" in out.outputs[0]["text"]


# -- memory ----------------------------------------------------------------------------------------
def test_reservation_rows_against_the_trace(run):
    worst = {rid: run.prompt_lens[rid] + n for rid, n in zip(run.request_ids, MAX_TOKENS)}
    rows = reservation_rows(run.trace, 2048, worst)
    for row, entry in zip(rows, run.trace):
        running = entry["block_tables"]
        assert row["paged"] == entry["slots_reserved"] == BLOCK * sum(len(t) for t in running.values())
        assert row["contiguous, max_model_len each"] == 2048 * len(running)
        assert row["contiguous, prompt + max_tokens each"] >= row["tokens stored"]
    shares = {r["strategy"]: r["share of reserved slots used"] for r in reservation_summary(rows, 6144)}
    assert shares["paged"] > shares["contiguous, prompt + max_tokens each"] > shares["contiguous, max_model_len each"]
    assert "paged" in reservation_text(rows, 6144)
    assert len(reservation_figure(rows).data) == 2 * 3 + 1


def test_block_size_rows_by_hand():
    rows = {r["block size"]: r for r in block_size_rows([1, 16, 17], [8, 16], shared_prefix=20)}
    assert rows[16]["table entries"] == 1 + 1 + 2
    assert rows[16]["empty slots"] == 4 * 16 - 34
    assert rows[8]["table entries"] == 1 + 2 + 3 and rows[8]["empty slots"] == 48 - 34
    assert rows[16]["shareable prefix tokens"] == 16 and rows[8]["shareable prefix tokens"] == 16
    assert "block size" in block_size_text(list(rows.values()))
    fig = block_size_figure([1, 16, 17], 16, list(rows.values()))
    assert list(fig.data[1].y) == [15, 0, 15]  # empty slots per sequence at block size 16
    widget = block_size_widget([1, 16, 17], block_size=16)
    widget.children[0].value = 32
    assert "block size 32: 3 block-table entries" in widget.children[1].outputs[1]["text"]


# -- what a learner sees: row order, full labels, no spurious warnings ------------------------------
def test_timeline_lists_requests_in_arrival_order(run):
    fig = timeline_figure(run)
    assert list(fig.layout.yaxis.categoryarray) == run.request_ids  # r0 at the top (axis reversed)
    assert fig.layout.yaxis.categoryorder == "array" and fig.layout.yaxis.autorange == "reversed"


def test_widget_labels_are_not_cut_off():
    widget = scheduler_widget(lambda **knobs: make_llm(**knobs), PROMPTS[:1], PARAMS[:1])
    labelled = [w for w in _walk(widget) if getattr(w, "description", "") and hasattr(w.style, "description_width")]
    assert {w.description for w in labelled} >= {"max_num_seqs", "max_num_batched_tokens"}
    assert all(w.style.description_width == "initial" for w in labelled)


def _walk(w):
    yield w
    for child in getattr(w, "children", ()):
        yield from _walk(child)


def test_long_text_warning_is_silenced_after_setup(caplog):
    from transformers import AutoTokenizer

    from llmopt import model_path

    tok = AutoTokenizer.from_pretrained(model_path("tiny"))
    setup_notebook()
    with caplog.at_level("WARNING"):
        tok("x " * (tok.model_max_length + 10))
    assert not [r for r in caplog.records if "Token indices sequence length" in r.getMessage()]


def test_kv_share_keeps_significant_digits():
    from llmopt.viz.kv_calculator import percent

    assert [percent(x) for x in (0.000215, 0.05, 0.456, 12.3)] == ["0.021%", "5%", "46%", "1,230%"]


def test_legends_sit_below_the_axis_titles(run):
    fig = block_table_figure(run.trace, len(run.trace) - 1)
    assert fig.layout.legend.yref == "container" and fig.layout.legend.yanchor == "bottom"


def test_outlier_rows_match_the_first_blocks_inputs_by_hand():
    import torch

    from llmopt import model_path
    from llmopt.model.loader import load_model
    from llmopt.viz.quant import OUTLIER_INPUTS, outlier_rows

    model = load_model(model_path("tiny"))
    windows = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    rows = outlier_rows(model, windows)
    assert [r["block"] for r in rows] == list(range(model.config.num_hidden_layers))
    assert all(r[k] >= 1 for r in rows for k in OUTLIER_INPUTS)
    # block 0's q/k/v input is the normed embedding: its channel means by hand
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(windows.flatten()))
    m = x.abs().mean(0)
    assert rows[0]["q/k/v"] == pytest.approx(float(m.max() / m.median()), rel=1e-5)
