"""Lesson 07's views: the numbers behind the FP8 grids, the value picker and the scale sweep
agree with the format definitions, and every widget builds and has its text form."""

import pytest
import torch

from llmopt.fp8.format import E4M3, E5M2, dequantize_fp8, quantize_fp8
from llmopt.viz import fp8 as v


def test_format_rows_state_the_formats():
    rows = {r["format"]: r for r in v.format_rows()}
    assert rows["e4m3"]["largest"] == "448" and rows["e5m2"]["largest"] == "57344"
    assert rows["e4m3"]["range (binades)"] == pytest.approx(17.8, abs=0.05)  # log2(448 / 2^-9)
    assert rows["float16"]["largest"] == "65504"
    assert [rows[n]["bits"] for n in ("e4m3", "e5m2", "float16", "bfloat16")] == [8, 8, 16, 16]


def test_spacing_figure_is_the_gap_to_the_next_value():
    fig = v.spacing_figure(points=10_000)
    e4m3 = next(t for t in fig.data if t.name == "e4m3")
    # subnormals: a fixed step of 2^-9; the top binade [256, 448]: steps of 32
    assert e4m3.y[0] == 2.0 ** -9 and e4m3.y[-1] == 32.0 and e4m3.x[-1] == 416.0
    assert all(b >= a for a, b in zip(e4m3.y, e4m3.y[1:]))


def test_neighbours_bits_and_errors():
    rows = {(r["x"], r["format"]): r for r in v.neighbour_rows([300.0, 0.003, 1000.0])}
    r = rows[(300.0, "e4m3")]
    assert (r["below"], r["above"], r["stored"], r["bits"]) == (288.0, 320.0, 288.0, "0 1111 001")
    assert rows[(1000.0, "e4m3")]["stored"] == 448.0 and rows[(1000.0, "e4m3")]["bits"] == "0 1111 110"
    assert rows[(1000.0, "e5m2")]["stored"] == 1024.0 and rows[(1000.0, "e5m2")]["bits"] == "0 11001 00"
    assert rows[(0.003, "e4m3")]["bits"] == "0 0000 010"  # a subnormal: 2 x 2^-9
    assert "288 and 320" in v.neighbour_text(300.0, "e4m3")
    assert "clamped first" in v.neighbour_text(1000.0, "e4m3")


def test_scale_error_regions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 5
    amax = x.abs().max().item()
    at_amax = v.scale_error(x, amax / E4M3.max, "e4m3")
    assert at_amax["clamped"] == 0 and at_amax["relative RMS error"] < 0.04
    back = dequantize_fp8(quantize_fp8(x, amax / 448), amax / 448)
    assert at_amax["relative RMS error"] == pytest.approx(((back - x).norm() / x.norm()).item())
    too_small = v.scale_error(x, amax / E4M3.max / 10, "e4m3")
    assert too_small["clamped"] > 0.1 and too_small["relative RMS error"] > 0.3
    too_large = v.scale_error(x, 1e4, "e4m3")
    assert too_large["flushed to zero"] > 0.5
    # e5m2 reaches down to 2^-16: at the same scale it flushes only values within 2^-17 x 1e4 of zero
    assert v.scale_error(x, 1e4, "e5m2")["flushed to zero"] == pytest.approx(
        (x.abs() / 1e4 <= 2.0 ** -17).float().mean().item())
    rows = v.scale_sweep_rows(x, decades=(-2, 2), per_decade=2)
    assert len(rows) == 2 * 9 and {r["format"] for r in rows} == {"e4m3", "e5m2"}
    assert E5M2.max == 57344


def test_capture_kv_and_widgets(tiny_llm):
    ids = tiny_llm.tokenizer("def fibonacci(n):\n    return n", add_special_tokens=False)["input_ids"]
    k, v_ = v.capture_kv(tiny_llm.model, ids, layer=2)
    cfg = tiny_llm.llm_engine.model_config
    assert k.shape == v_.shape == (len(ids), cfg.num_key_value_heads, cfg.head_dim)
    for widget in (v.fp8_value_widget(1000.0, "e5m2"), v.scale_widget(k, "keys")):
        assert repr(widget).startswith("[interactive widget:")
    # 0, 7 subnormals, 8 normals in each of the 8 binades from 2^-6 to 2^2, and 4 itself
    assert v.grid_figure(0, 4).data[0].name == "e4m3 (73 values)"
    assert "Hopper" in v.native_table() and v.this_machine().startswith("this machine:")
