"""The generation loops: the KV cache changes speed, never tokens; stops happen where they should."""

import pytest
import torch

from llmopt import SamplingParams
from llmopt.engine.reference_loops import generate_naive, generate_with_cache
from llmopt.sequence import Sequence

PROMPTS = ["def fibonacci(n):", "class Parser:\n    def __init__(self", "import sys\n\n"]


def run(llm, loop, params_list, prompts=PROMPTS):
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        seqs.append(Sequence(str(i), p, llm.tokenizer(p)["input_ids"], sp, gen))
    loop(llm.model, seqs, eos_token_ids=llm.eos_token_ids, max_model_len=llm.max_model_len,
         tokenizer=llm.tokenizer)
    return [s.output_token_ids for s in seqs]


def test_naive_and_cached_loops_give_identical_greedy_tokens(tiny_llm):
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * 3
    assert run(tiny_llm, generate_naive, params) == run(tiny_llm, generate_with_cache, params)


def test_naive_and_cached_loops_give_identical_seeded_samples(tiny_llm):
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=s, max_tokens=32,
                             ignore_eos=True) for s in (1, 2, 3)]
    assert run(tiny_llm, generate_naive, params) == run(tiny_llm, generate_with_cache, params)


def test_seeded_request_is_the_same_alone_and_in_a_batch(tiny_llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = tiny_llm.generate(["def parse(text):"], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = tiny_llm.generate(["x = 1\n", "def parse(text):", "import re"], [others, p, others],
                              use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = tiny_llm.generate(["def parse(text):"], SamplingParams(
        temperature=1.0, seed=99, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_max_tokens_and_max_model_len_finish_with_length():
    from llmopt import LLM

    llm = LLM(model="tiny", max_model_len=24)
    ids = llm.tokenizer("def f(x):")["input_ids"]
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(ids) + len(out.outputs[0].token_ids) == 24
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_strings_stop_tokens_and_eos(tiny_llm):
    base = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    full = tiny_llm.generate(["def fibonacci(n):"], base, use_tqdm=False)[0].outputs[0]
    # choose a stop string that really occurs in the greedy text, after its first character
    stop = full.text[5:8]
    assert stop and stop in full.text
    cut = tiny_llm.generate(["def fibonacci(n):"], SamplingParams(
        temperature=0.0, max_tokens=64, stop=[stop], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids
    kept = tiny_llm.generate(["def fibonacci(n):"], SamplingParams(
        temperature=0.0, max_tokens=64, stop=stop, include_stop_str_in_output=True, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]

    tok = full.token_ids[10]
    by_token = tiny_llm.generate(["def fibonacci(n):"], SamplingParams(
        temperature=0.0, max_tokens=64, stop_token_ids=[tok], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_token.token_ids == full.token_ids[:full.token_ids.index(tok) + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == tok

    # EOS: a sequence that reaches EOS stops there with "stop" unless ignore_eos
    eos = tiny_llm.tokenizer.eos_token_id
    seq = Sequence("e", None, [1, 5], SamplingParams(max_tokens=10))
    seq.append_token(eos, 0.0)
    seq.check_stop({eos}, 100, None)
    assert seq.finish_reason == "stop"
    seq = Sequence("e", None, [1, 5], SamplingParams(max_tokens=10, min_tokens=2))
    seq.append_token(eos, 0.0)
    seq.check_stop({eos}, 100, None)
    assert not seq.is_finished  # min_tokens holds EOS back


def test_logprobs_are_consistent(tiny_llm):
    out = tiny_llm.generate(["def f("], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_outputs_carry_metrics(tiny_llm):
    out = tiny_llm.generate(["def f("], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]
    m = out.metrics
    assert out.finished and m.ttft > 0 and m.tpot > 0 and m.e2e_latency >= m.ttft
    assert len(m.token_times) == 8
