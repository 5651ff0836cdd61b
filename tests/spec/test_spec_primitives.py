"""Speculative decoding's building blocks: the rejection sampler is exact, n-gram lookup finds
the most recent match. (Wiring them into the engine is separate work.)"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from llmopt.spec.ngram import propose_ngram
from llmopt.spec.rejection_sampler import rejection_sample

V = 12


def dist(seed, support=None):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g) ** 2
    if support is not None:
        mask = torch.zeros(V)
        mask[support] = 1
        p = p * mask
    return p / p.sum()


def run(p, q, n=5000, one_hot_drafts=False, sampler=rejection_sample):
    """Draw drafts from q, verify against p; collect the 1st and 2nd emitted tokens."""
    g = torch.Generator().manual_seed(11)
    k = q.shape[0]
    first, second = [], []
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)])
        out = sampler(p, None if one_hot_drafts else q, drafts, generator=g)
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
    return np.array(first), np.array(second)


def matches(samples, probs):
    probs = probs.double().numpy()
    counts = np.bincount(samples, minlength=V)
    assert counts[probs == 0].sum() == 0, "emitted a token the target gives probability 0"
    support = probs > 0
    return chisquare(counts[support], probs[support] / probs[support].sum() * len(samples)).pvalue


CASES = {
    "random p and q": (lambda: torch.stack([dist(1), dist(2), dist(3)]),
                       lambda: torch.stack([dist(4), dist(5)])),
    "p equals q": (lambda: torch.stack([dist(1), dist(2), dist(3)]),
                   lambda: torch.stack([dist(1), dist(2)])),
    "disjoint supports": (lambda: torch.stack([dist(1, [0, 1, 2, 3]), dist(2, [0, 1, 2, 3]), dist(3)]),
                          lambda: torch.stack([dist(4, [6, 7, 8]), dist(5, [6, 7, 8])])),
}


@pytest.mark.parametrize("case", CASES)
def test_emitted_tokens_follow_the_target(case):
    p, q = CASES[case][0](), CASES[case][1]()
    first, second = run(p, q)
    assert matches(first, p[0]) > 1e-3
    if case != "disjoint supports":  # (with disjoint supports nothing is ever accepted)
        assert matches(second, p[1]) > 1e-3
    else:
        assert len(second) == 0


def test_one_hot_drafts_as_from_ngram_lookup():
    p = torch.stack([dist(1), dist(2), dist(3)])
    q = torch.stack([dist(4), dist(5)])  # where the guesses come from; the sampler sees one-hot
    first, _ = run(p, q, one_hot_drafts=True)
    assert matches(first, p[0]) > 1e-3


def test_negative_control_always_accepting_fails():
    def always_accept(p, q, drafts, generator=None):
        return drafts.tolist()

    p, q = torch.stack([dist(1), dist(2), dist(3)]), torch.stack([dist(4), dist(5)])
    first, _ = run(p, q, sampler=always_accept)
    assert matches(first, p[0]) < 1e-6


def one_hot(ids):
    t = torch.zeros(len(ids), V)
    t[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
    return t


@pytest.mark.parametrize("target,drafts,expected", [
    ([5, 6, 7, 8, 9], [1, 6, 7, 8], [5]),            # mismatch at the first position
    ([5, 6, 7, 8, 9], [5, 6, 1, 8], [5, 6, 7]),      # in the middle
    ([5, 6, 7, 8, 9], [5, 6, 7, 1], [5, 6, 7, 8]),   # at the last
    ([5, 6, 7, 8, 9], [5, 6, 7, 8], [5, 6, 7, 8, 9]),  # all accepted: the bonus token
])
def test_greedy_is_argmax_matching(target, drafts, expected):
    p = one_hot(target) * 0.9 + 0.1 / V  # argmax = target, not one-hot
    out = rejection_sample(p, None, torch.tensor(drafts), greedy=True)
    assert out == expected
    # and a scripted sampling run with one-hot p agrees: acceptance is certain or impossible
    assert rejection_sample(one_hot(target), one_hot(drafts), torch.tensor(drafts),
                            generator=torch.Generator().manual_seed(0)) == expected


def test_ngram_prompt_lookup():
    ids = [1, 2, 3, 4, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the last 3-gram (1, 2, 3) occurred twice before; the most recent match wins
    assert propose_ngram(ids, k=2, prompt_lookup_min=1, prompt_lookup_max=3) == [7, 8]
    assert propose_ngram(ids, k=5, prompt_lookup_max=3) == [7, 8, 1, 2, 3]
    assert propose_ngram([5, 6, 7], k=3) == []                  # nothing repeats
    assert propose_ngram([4, 4], k=3, prompt_lookup_min=1) == [4]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        propose_ngram(ids, k=2, prompt_lookup_min=3, prompt_lookup_max=2)
