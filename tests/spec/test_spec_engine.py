"""Speculative decoding inside the engine, for every method (n-gram lookup, the draft model,
the EAGLE head): greedy output equals plain greedy decoding, alone and batched, with prefix
caching, chunked prefill and preemption; stops land where plain decoding puts them;
rejected drafts' blocks are rolled back; scripted models pin down exactly what is accepted;
sampling with speculation draws from the same distribution as plain sampling."""

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chi2_contingency

from llmopt import LLM, SamplingParams
from llmopt.worker.model_runner import StepBackend

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4}
EAGLE = {"method": "eagle", "model": "tiny-eagle", "num_speculative_tokens": 4}
METHODS = pytest.mark.parametrize("spec", [NGRAM, DRAFT, EAGLE], ids=lambda c: c["method"])
PROMPTS = ["import os\nimport sys\nimport os\nimport sys\nimport",
           "def f(x):\n    return x\n\n\ndef g(x):\n    return x\n\n\ndef",
           "class A:\n    def __init__(self):\n        self.a = 1\n        self.b = 2\n        self.",
           "x = [1, 2, 3, 1, 2, 3, 1, 2,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llm):
    return tokens(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@METHODS
def test_greedy_speculation_equals_plain_greedy(plain, spec):
    llm = LLM(model="tiny", speculative_config=spec)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    for i, p in enumerate(PROMPTS):  # and each request alone
        assert tokens(llm.generate([p], GREEDY, use_tqdm=False)) == [plain[i]]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts"] > 0
    assert 0 < m["spec_decode_num_accepted_tokens"] <= m["spec_decode_num_draft_tokens"]
    per_pos = [m[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(4)]
    assert sum(per_pos) == m["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # position i is reached only through i - 1
    assert m["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_drafts"])
    assert m["generation_tokens"] == 2 * len(PROMPTS) * 48
    llm.llm_engine.block_manager.check_invariants()


@METHODS
def test_with_chunked_prefill_prefix_caching_and_preemption(plain, spec):
    tight = LLM(model="tiny", speculative_config=spec, block_size=8, num_kv_blocks=14,
                max_num_batched_tokens=9)
    assert tokens(tight.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    assert tight.get_metrics()["num_preemptions"] > 0
    eng = tight.llm_engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    # a second pass hits the prefix cache and still gives the same tokens
    assert tokens(tight.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain


@METHODS
def test_stops_inside_an_accepted_run_match_plain(tiny_llm, spec):
    spec = LLM(model="tiny", speculative_config=spec)
    for params in (SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=48, stop=["sys"], ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=48),
                   # min_tokens holds the newline token back: the target's masked distributions
                   # reject drafts of it, as plain sampling never draws it
                   SamplingParams(temperature=0.0, max_tokens=24, min_tokens=16, ignore_eos=True,
                                  stop_token_ids=tiny_llm.tokenizer("\n", add_special_tokens=False)["input_ids"])):
        want = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
        got = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
            [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]


@METHODS
def test_sampling_with_speculation_runs_and_keeps_blocks_consistent(spec):
    llm = LLM(model="tiny", speculative_config=spec, block_size=8)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True)
              for s in range(4)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(t) for t in tokens(outs)] == [40] * 4
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(again) == tokens(outs)  # seeded: reproducible
    eng = llm.llm_engine
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("config,match", [
    ({"method": "draft_model", "model": "no-such-draft", "num_speculative_tokens": 4}, "no-such-draft"),
    ({"method": "eagle", "model": "tiny-draft", "num_speculative_tokens": 4}, "EagleLlamaForCausalLM"),
    ({"method": "draft_model", "num_speculative_tokens": 4, "prompt_lookup_max": 2}, "unknown keys"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
])
def test_bad_speculative_config(config, match):
    with pytest.raises(ValueError, match=match):
        LLM(model="tiny", speculative_config=config)


# -- scripted models: logits fixed by position, so every acceptance is known in advance ----------
class Scripted(torch.nn.Module):
    """Predicts script[p + 1] after position p, whatever the context."""

    def __init__(self, script: list[int], vocab: int = 4096):
        super().__init__()
        self.script, self.vocab = script, vocab
        self.config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=16,
                                      vocab_size=vocab)

    def forward(self, input_ids, meta, kv_cache):
        return meta.positions.float()[:, None]

    def compute_logits(self, hidden):
        nxt = torch.tensor([self.script[int(p) + 1] for p in hidden[:, 0]])
        logits = torch.zeros(len(nxt), self.vocab)
        logits[torch.arange(len(nxt)), nxt] = 10.0
        return logits


def scripted_engine(target: list[int], draft: list[int]):
    eng = LLM(model="tiny", speculative_config={"method": "draft_model", "model": "tiny-draft",
                                                "num_speculative_tokens": 4}).llm_engine
    eng.runner.backend = StepBackend(Scripted(target), eng.kv_cache)
    eng.proposer.model = Scripted(draft)
    return eng


def expected_run(target, draft, prompt_len, max_tokens, k=4, eos=0):
    """Plain greedy plus the acceptance pattern, by hand: per verification step, how many
    of the drafts (draft[L..L+k-1]) match the target's tokens there."""
    out, accepted = [target[prompt_len]], []  # the prefill step samples the first token
    while len(out) < max_tokens and eos not in out:
        L = prompt_len + len(out)
        kk = min(k, max_tokens - len(out) - 1)
        if kk == 0:
            out.append(target[L])
            continue
        a = 0
        while a < kk and draft[L + a] == target[L + a]:
            a += 1
        accepted.append(a)
        out += target[L:L + a + 1]
    cut = out.index(eos) + 1 if eos in out else len(out)
    return out[:min(cut, max_tokens)], accepted


@pytest.mark.parametrize("wrong_at,max_tokens,eos_at", [
    ((), 21, None),                  # every draft right: 4 accepted + a bonus per step
    ((7,), 21, None),                # mismatch at the first draft position of a step
    ((9,), 21, None),                # in the middle
    ((10,), 21, None),               # at the last
    ((7, 12, 13, 19), 21, None),     # a mixture
    ((), 9, None),                   # max_tokens inside an accepted run
    ((), 30, 12),                    # EOS inside an accepted run
    ((12,), 30, 12),                 # EOS as the replacement token
])
def test_scripted_acceptance(wrong_at, max_tokens, eos_at):
    prompt_len = 5
    target = [100 + i for i in range(60)]
    if eos_at is not None:
        target[eos_at] = 0
    draft = [t if i not in wrong_at else 7 for i, t in enumerate(target)]
    eng = scripted_engine(target, draft)
    eng.add_request("r", {"prompt_token_ids": target[:prompt_len]},
                    SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while eng.has_unfinished_requests():
        (out,) = eng.step()
    want, accepted = expected_run(target, draft, prompt_len, max_tokens)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].finish_reason == ("stop" if want[-1] == 0 else "length")
    m = eng.get_metrics()
    assert m["spec_decode_num_drafts"] == len(accepted)
    assert m["spec_decode_num_accepted_tokens"] == sum(accepted)
    assert [m[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(4)] == \
        [sum(a > i for a in accepted) for i in range(4)]
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks


# -- sampling: speculation changes the cost of a token, never its distribution ------------------
def early_token_counts(llm, n, seed0, position=2):
    prompt = "import os\nimport sys\nimport os\nimport"
    params = [SamplingParams(temperature=1.0, max_tokens=position + 1, seed=seed0 + i, ignore_eos=True)
              for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts: dict[int, int] = {}
    for o in outs:
        t = o.outputs[0].token_ids[position]
        counts[t] = counts.get(t, 0) + 1
    return counts


def chi2_p(a: dict, b: dict, min_count=10) -> float:
    """Two-sample chi-square test on token counts; rare tokens pooled into one bin."""
    keys = [t for t in set(a) | set(b) if a.get(t, 0) + b.get(t, 0) >= min_count]
    rows = [[a.get(t, 0) for t in keys], [b.get(t, 0) for t in keys]]
    rows[0].append(sum(a.values()) - sum(rows[0]))
    rows[1].append(sum(b.values()) - sum(rows[1]))
    return chi2_contingency(rows)[1]


N_SAMPLES = 1500


@pytest.fixture(scope="module")
def plain_samples(tiny_llm):
    """Two independent plain runs: how far apart two samples of the same distribution land."""
    return (early_token_counts(tiny_llm, N_SAMPLES, seed0=0),
            early_token_counts(tiny_llm, N_SAMPLES, seed0=N_SAMPLES))


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=lambda c: c["method"])
def test_sampled_early_token_matches_plain_sampling(plain_samples, spec):
    n = N_SAMPLES
    plain_a, plain_b = plain_samples
    llm = LLM(model="tiny", speculative_config=spec, max_num_seqs=256)
    specd = early_token_counts(llm, n, seed0=2 * n)
    assert llm.get_metrics()["spec_decode_num_drafts"] > n / 10  # speculation really ran
    noise = chi2_p(plain_a, plain_b)
    assert noise > 0.001  # the test itself is calibrated: two plain runs agree
    assert chi2_p(plain_a, specd) > 0.001, (noise, chi2_p(plain_a, specd))
