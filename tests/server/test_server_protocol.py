"""The server's pieces without a server: request parsing into SamplingParams, and the
incremental detokenizer (streamed deltas add up to the full decode, never a broken character)."""

import pytest

from llmopt.bench import heldout_text
from llmopt.server.detokenizer import IncrementalDetokenizer
from llmopt.server.protocol import APIError, parse_chat, parse_completion


def test_completion_fields_become_sampling_params():
    r = parse_completion({"model": "tiny", "prompt": ["def f():"], "max_tokens": 7, "temperature": 0,
                          "top_p": 0.5, "top_k": 4, "stop": "\n", "seed": 3, "ignore_eos": True,
                          "priority": -2, "stream": True, "stream_options": {"include_usage": True},
                          "presence_penalty": 0, "user": "u1"}, "tiny")
    p = r.params
    assert r.prompt == "def f():" and not r.is_chat and r.stream and r.include_usage and r.priority == -2
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop_strings, p.seed, p.ignore_eos) == (
        7, 0.0, 0.5, 4, ["\n"], 3, True)
    d = parse_completion({"model": "tiny", "prompt": [1, 2, 3]}, "tiny")
    assert d.prompt == [1, 2, 3] and d.params.max_tokens == 16 and d.params.temperature == 1.0  # OpenAI's defaults
    assert not d.stream and not d.include_usage


def test_chat_messages_and_defaults():
    r = parse_chat({"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 5}, "m")
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert r.params.max_tokens == 5 and r.is_chat
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "m").params.max_tokens is None


@pytest.mark.parametrize("body, param, status", [
    ({"model": "tiny", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty", 400),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 1}}, "logit_bias", 400),
    ({"model": "tiny", "prompt": "x", "echo": True}, "echo", 400),
    ({"model": "tiny", "prompt": "x", "logprobs": 2}, "logprobs", 400),
    ({"model": "tiny", "prompt": "x", "stop": ["a", ""]}, "stop", 400),
    ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ({"model": "tiny", "prompt": "x", "temperature": float("inf")}, "temperature", 400),
    ({"model": "tiny", "prompt": "x", "top_k": -3}, "top_k", 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": True}, "max_tokens", 400),
    ({"model": "tiny", "prompt": "x", "min_tokens": 20}, "min_tokens", 400),
    ({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"usage": True}}, "stream_options", 400),
    ({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "x"}},
     "stream_options", 400),  # passed unchecked
    ({"model": "tiny", "prompt": ["a", "b"]}, "prompt", 400),
    ({"model": "tiny", "prompt": [1, "a"]}, "prompt", 400),
    ({"model": 5, "prompt": "x"}, "model", 400),
    ({"model": "other", "prompt": "x"}, "model", 404),
])
def test_bad_fields_are_named(body, param, status):
    with pytest.raises(APIError) as e:
        parse_completion(body, "tiny")
    assert (e.value.param, e.value.status) == (param, status)
    assert e.value.to_dict()["error"]["param"] == param


def test_streamed_text_adds_up_to_the_full_decode(tiny_llm):
    tok = tiny_llm.tokenizer
    samples = [heldout_text()[5000:5600], "naïve café → 世界 😀 ok", "\x00 tabs\tand\r\nnewlines"]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.step(ids[:i]) for i in range(1, len(ids) + 1)]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in d for d in deltas)
        assert sum(bool(d) for d in deltas) > len(ids) // 2  # it does stream, token by token


def test_stop_strings_are_held_back_until_the_end(tiny_llm):
    tok = tiny_llm.tokenizer
    ids = tok("return self.items.pop()", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, stop=["STOP", "xy"])
    sent = "".join(detok.step(ids[:i]) for i in range(1, len(ids) + 1))
    full = tok.decode(ids)
    assert sent == full[:len(full) - 3]  # the longest stop string, less one character, waits
    assert sent + detok.step(ids, final_text=full) == full


def test_poisson_arrivals():
    from scipy import stats

    from llmopt.bench.load import poisson_arrivals

    times = poisson_arrivals(2000, rate=5.0, seed=7)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps) and times == poisson_arrivals(2000, 5.0, seed=7)
    # exponential gaps with mean 1/rate (Kolmogorov-Smirnov against the exponential law)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 5.0)).pvalue > 0.001
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    for bad in ((0, 1.0), (3, 0.0), (3, -1.0)):
        with pytest.raises(ValueError):
            poisson_arrivals(*bad)


def test_saturation_is_the_capacity_once_a_rate_is_not_kept_up():
    from llmopt.bench.load import saturation_rate

    def run(rate, served):
        return {"rate": rate, "offered_rate": rate, "request_throughput": served, "failed": 0}

    assert saturation_rate([run(1, 1.0), run(2, 1.95)]) is None          # kept up everywhere
    assert saturation_rate([run(1, 1.0), run(4, 2.5), run(8, 2.7)]) == 2.7  # capacity: the most served
