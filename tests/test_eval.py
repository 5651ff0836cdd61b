"""llmopt.eval.perplexity: equal to the textbook computation in transformers, the same
however the windows are chunked and batched, and strict about its arguments."""

import math

import pytest
import torch
import torch.nn.functional as F

from llmopt import model_path
from llmopt.eval import heldout_text, perplexity


def reference_perplexity(folder, ids: list[int], seq_len: int) -> float:
    """transformers on the same non-overlapping windows (each shares one token with the next)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, seq_len):
            w = torch.tensor(ids[s:s + seq_len + 1])
            logits = model(input_ids=w[None, :-1]).logits[0].float()
            nll += F.cross_entropy(logits, w[1:], reduction="sum").item()
            n += len(w) - 1
    return math.exp(nll / n)


def test_splits_are_disjoint_and_cover_the_file():
    cal, ev, full = heldout_text("calibration"), heldout_text("eval"), heldout_text("all")
    assert cal + ev == full
    assert cal.endswith("\n") and len(cal) > 50_000 and len(ev) > 200_000
    with pytest.raises(ValueError, match="split"):
        heldout_text("train")


def test_perplexity_equals_transformers(tiny_llm):
    ids = tiny_llm.tokenizer(heldout_text("eval")[:6000], add_special_tokens=False)["input_ids"][:700]
    got = perplexity(tiny_llm, token_ids=ids, seq_len=256)
    want = reference_perplexity(model_path("tiny"), ids, seq_len=256)
    assert got == pytest.approx(want, rel=1e-5)
    assert 10 < got < 500  # a trained model on Python text: far below the vocabulary size


def test_chunked_and_batched_equal_whole_windows(tiny_llm):
    whole = perplexity(tiny_llm, max_tokens=600, seq_len=200, batch_size=8)
    chunked = perplexity(tiny_llm, max_tokens=600, seq_len=200, chunk_size=48, batch_size=8)
    one_at_a_time = perplexity(tiny_llm, max_tokens=600, seq_len=200, chunk_size=48, batch_size=1)
    assert chunked == pytest.approx(whole, rel=1e-5)
    assert one_at_a_time == pytest.approx(whole, rel=1e-5)
    # the engine is left as it was: no blocks held, requests still run
    assert tiny_llm.llm_engine.block_manager.num_free_blocks == tiny_llm.llm_engine.num_blocks


def test_text_argument_is_tokenized_without_bos(tiny_llm):
    text = heldout_text("eval")[:1500]
    ids = tiny_llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert perplexity(tiny_llm, text=text) == pytest.approx(perplexity(tiny_llm, token_ids=ids), rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=1), "seq_len"),
    (dict(seq_len=10**6), "max_model_len"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(batch_size=True), "batch_size"),
    (dict(text=""), "at least 2"),
    (dict(token_ids=[5]), "at least 2"),
    (dict(token_ids=[5, 99999]), r"\[0, 4096\)"),
    (dict(text="x", token_ids=[1, 2]), "not both"),
])
def test_bad_arguments(tiny_llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        perplexity(tiny_llm, **kwargs)


def test_needs_an_llm():
    with pytest.raises(TypeError, match="LLM"):
        perplexity("tiny")
    with pytest.raises(TypeError, match="text"):
        from llmopt import LLM

        perplexity(LLM("tiny-draft"), text=b"bytes")


def test_window_nll_adds_up_to_perplexity(tiny_llm):
    from llmopt.eval import window_nll

    per_window = window_nll(tiny_llm, max_tokens=700, seq_len=256, batch_size=2)
    assert [n for _, n in per_window] == [256, 256, 187]  # 699 tokens predicted, each once
    ppl = math.exp(sum(v for v, _ in per_window) / 699)
    assert ppl == pytest.approx(perplexity(tiny_llm, max_tokens=700, seq_len=256), rel=1e-6)
    chunked = window_nll(tiny_llm, max_tokens=700, seq_len=256, chunk_size=100)
    for (a, _), (b, _) in zip(per_window, chunked):
        assert a == pytest.approx(b, rel=1e-5)


def test_the_smollm2_tables_share_one_protocol_and_one_fp32_baseline():
    """The committed tables lessons 06 and 07 set side by side score the same tokens in the same
    windows, so their full-precision rows agree: one baseline, not one per table."""
    import json

    from llmopt.eval import PROTOCOL, follows_protocol, perplexity_of
    from llmopt.package_data import committed_result

    baselines = {}
    for name, base_row in (("precision_smollm2.json", "fp32"), ("quant_smollm2.json", "fp32"),
                           ("fp8_smollm2.json", "full precision")):
        row = next(r for r in json.loads(committed_result(name).read_text())["rows"] if r["name"] == base_row)
        assert follows_protocol(row["window_nll"]), f"{name} does not follow {PROTOCOL}"
        baselines[name] = perplexity_of(row["window_nll"])
    assert max(baselines.values()) / min(baselines.values()) - 1 < 1e-4, baselines


def test_follows_protocol_tells_other_windows_apart():
    from llmopt.eval import PROTOCOL, follows_protocol

    n, w = PROTOCOL["max_tokens"] - 1, PROTOCOL["seq_len"]
    whole = [(1.0, w)] * (n // w) + [(1.0, n % w)]
    assert follows_protocol(whole)
    assert not follows_protocol(whole[:-1])                      # fewer tokens
    assert not follows_protocol([(1.0, w // 2)] * (2 * (n // w)) + [(1.0, n % w)])   # shorter windows


def test_forced_gaps_equal_transformers_and_are_zero_on_the_engines_own_greedy_tokens(tiny_llm):
    """The engine as its own teacher-forced judge (what the GPU check uses): the same gaps as
    transformers' `greedy_gaps` on the same tokens, zero for its own greedy choices and the
    log-probability difference for a token put in their place."""
    from transformers import AutoModelForCausalLM

    from llmopt import SamplingParams
    from llmopt.eval import forced_gaps, greedy_gaps

    ids = tiny_llm.tokenizer(heldout_text("eval")[:4000], add_special_tokens=False)["input_ids"]
    prompts = [ids[0:20], ids[100:131], ids[300:309]]
    outs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    greedy = [o.outputs[0].token_ids for o in outs]
    own = forced_gaps(tiny_llm, prompts, greedy)
    assert own.shape == (36,) and float(own.abs().max()) < 1e-4
    wrong = [g[:5] + [(g[5] + 1) % 1000] + g[6:] for g in greedy]
    hf = AutoModelForCausalLM.from_pretrained(model_path("tiny"), dtype=torch.float32).eval()
    mine, theirs = forced_gaps(tiny_llm, prompts, wrong), greedy_gaps(hf, prompts, wrong)
    assert torch.allclose(mine, theirs, atol=1e-4)
    assert bool((mine.view(3, 12)[:, 5] > 0.01).all())  # the planted tokens are not the best
    assert forced_gaps(tiny_llm, [[1, 2]], [[]]).numel() == 0
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        forced_gaps(tiny_llm, [[1], [2]], [[3]])
    with pytest.raises(TypeError, match="llmopt LLM"):
        forced_gaps(hf, prompts, greedy)
