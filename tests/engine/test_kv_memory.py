"""The KV memory calculator against numbers worked out by hand, and the lesson views it feeds."""

import json

import pytest
import torch

from llmopt import model_path
from llmopt.kv_bytes import DTYPE_BYTES, PRESETS, KVSpec, format_bytes, kv_bytes_per_token, mla_bytes_per_token
from llmopt.worker.kv_cache import ContiguousKVCache


def test_llama2_70b_gqa_by_hand():
    # 80 layers x 8 KV heads x 128 head_dim x 2 (K and V) x 2 bytes (bf16)
    assert PRESETS["Llama-2-70B"].bytes_per_token() == 327_680
    assert PRESETS["Llama-2-70B"].attention == "GQA"
    # one 4,096-token sequence: 1.34 GB, far from 40 GB
    assert PRESETS["Llama-2-70B"].cache_bytes(4096) == 1_342_177_280
    # 29 such sequences fit in 40 GB; the 30th passes it
    assert PRESETS["Llama-2-70B"].max_concurrency(40e9, 4096) == 29
    assert 29 * 1_342_177_280 <= 40e9 < 30 * 1_342_177_280


def test_mha_by_hand():
    # Llama-2-7B: 32 layers x 32 KV heads (= query heads) x 128 x 2 x 2 bytes
    spec = PRESETS["Llama-2-7B"]
    assert spec.attention == "MHA"
    assert spec.bytes_per_token() == 524_288
    assert spec.bytes_per_token(DTYPE_BYTES["float32"]) == 1_048_576
    # batch 8 x 2,048 tokens in fp16
    assert spec.cache_bytes(2048, batch_size=8) == 8 * 2048 * 524_288 == 8_589_934_592


def test_the_70b_claim_with_mha():
    # Llama-2-70B's shape with 64 KV heads: 80 x 64 x 128 x 2 x 2 = 2,621,440 bytes per token,
    # 10.74 GB per 4K sequence: 3 sequences stay under 40 GB, 4 pass it.
    spec = KVSpec("70B-MHA", 80, 64, 64, 128)
    assert spec.bytes_per_token() == 2_621_440
    assert spec.cache_bytes(4096) == 10_737_418_240
    assert spec.max_concurrency(40e9, 4096) == 3


def test_deepseek_v3_mla_by_hand():
    # MLA caches kv_lora_rank 512 + qk_rope_head_dim 64 numbers per token per layer, 61 layers,
    # once for all heads (no x2 for K and V): 61 x 576 x 2 bytes
    spec = PRESETS["DeepSeek-V3"]
    assert spec.attention == "MLA"
    assert spec.bytes_per_token() == 61 * 576 * 2 == 70_272
    assert mla_bytes_per_token(61, 512, 64, 1) == 35_136  # fp8
    # cached per head as MHA would: 61 layers x 128 heads x (192 key + 128 value) x 2 bytes
    assert 61 * 128 * (192 + 128) * 2 == 4_997_120


def test_other_presets_by_hand():
    assert PRESETS["Llama-3-8B"].bytes_per_token() == 32 * 8 * 128 * 2 * 2 == 131_072
    assert PRESETS["Llama-3-70B"].bytes_per_token() == 327_680
    assert PRESETS["Mistral-7B"].bytes_per_token() == 131_072
    assert PRESETS["Falcon-7B"].attention == "MQA"
    assert PRESETS["Falcon-7B"].bytes_per_token() == 32 * 1 * 64 * 2 * 2 == 8_192
    # 20 GB / (131,072 bytes x 8,192 tokens) = 18.6 -> 18 requests (lesson 01, exercise 2)
    assert PRESETS["Llama-3-8B"].max_concurrency(20e9, 8192) == 18


def test_tiny_matches_its_config_and_the_engine_cache():
    config = json.loads((model_path("tiny") / "config.json").read_text())
    tiny = PRESETS["tiny"]
    assert (tiny.num_layers, tiny.num_kv_heads, tiny.head_dim) == (
        config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"])
    # 6 layers x 2 KV heads x 64 x 2 x 4 bytes (float32, as it runs on CPU)
    assert tiny.bytes_per_token(4) == 6_144
    cache = ContiguousKVCache(6, 3, 100, 2, 64, dtype=torch.float32)
    assert cache.bytes_reserved == tiny.cache_bytes(100, 3, dtype_bytes=4) == 3 * 100 * 6_144


def test_from_hf_config_reads_gqa_and_mla():
    llama = KVSpec.from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32,
                                   "num_key_value_heads": 8, "hidden_size": 4096})
    assert (llama.head_dim, llama.attention, llama.bytes_per_token()) == (128, "GQA", 131_072)
    mha = KVSpec.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    assert (mha.num_kv_heads, mha.attention) == (4, "MHA")
    deepseek = KVSpec.from_hf_config({
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128})
    assert (deepseek.attention, deepseek.kv_lora_rank, deepseek.qk_rope_head_dim) == ("MLA", 512, 64)
    assert deepseek.bytes_per_token() == PRESETS["DeepSeek-V3"].bytes_per_token() == 70_272
    assert deepseek.head_dim == 128 + 64  # key width per head: no-RoPE part + RoPE part


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_shapes_are_rejected(bad):
    with pytest.raises(ValueError):
        kv_bytes_per_token(bad, 8, 128)
    with pytest.raises(ValueError):
        PRESETS["Llama-3-8B"].cache_bytes(bad)


def test_format_bytes_uses_decimal_units():
    assert format_bytes(1_342_177_280) == "1.34 GB"
    assert format_bytes(70_272) == "70.27 kB"
    assert format_bytes(512) == "512 B"


# -- the lesson views build without error ------------------------------------------------------

def test_viz_builds_figures_tables_and_widgets():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from llmopt import LLM
    from llmopt.viz import format_table, setup_notebook
    from llmopt.viz.kv_calculator import kv_calculator_widget, kv_figure, kv_table
    from llmopt.viz.latency import latency_figure, latency_table
    from llmopt.viz.next_token import next_token_figure, next_token_rows, next_token_widget

    assert setup_notebook() == "plotly_mimetype"
    specs = list(PRESETS.values())
    assert "327,680" in kv_table(specs, 4096)
    assert len(kv_figure(specs, 4096, batch_size=30).data[0].y) == len(specs)

    calc = kv_calculator_widget(preset="DeepSeek-V3")
    assert repr(calc).startswith("[interactive widget: KV memory calculator")
    readout = calc.children[-1].outputs[0]["text"]
    assert "70,272" in readout and "MLA" in readout
    figure = calc.children[-1].outputs[1]["data"]
    assert "application/vnd.plotly.v1+json" in figure

    runs = {"a": ([10, 11, 12], [0.01, 0.02, 0.03]), "b": ([10, 11, 12], [0.01, 0.01, 0.01])}
    assert len(latency_figure(runs).data) == 4
    assert "20.00" in latency_table(runs, at=[11])

    llm = LLM(model="tiny", device="cpu", dtype="float32")
    ids = llm.tokenizer("def f(x):")["input_ids"]
    rows = next_token_rows(llm, ids, temperature=0.0, top_n=5)
    assert [r["p (sampled from)"] for r in rows] == [1.0, 0.0, 0.0, 0.0, 0.0]  # greedy: all on the top token
    assert len(next_token_figure(rows).data) == 2
    explorer = next_token_widget(llm, "def f(x):", top_n=5)
    greedy_button = explorer.children[2].children[0]
    greedy_button.click()  # appends the top token and redraws
    assert "tokens" in explorer.children[3].value

    # numbers right-aligned with separators, text left-aligned
    assert format_table([{"n": 1234, "name": "x"}]).splitlines() == ["    n  name", "-----  ----", "1,234  x"]


def test_check_answer_messages(capsys):
    from llmopt.viz import check_answer

    def unanswered():
        raise NotImplementedError

    check_answer("q", unanswered, 4)
    check_answer("q", lambda: 4, 4)
    check_answer("q", lambda: 5, 4, hint="think again")
    out = capsys.readouterr().out.splitlines()
    assert out == ["q: not answered yet. Fill in the exercise cell above, run it, then run this cell.",
                   "q: correct (4).", "q: not yet: your answer is 5. think again"]
