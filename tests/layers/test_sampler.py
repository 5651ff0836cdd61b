"""The sampler draws from exactly the distribution its parameters define.

Expected distributions are computed here from the definitions (numpy, one row at a
time), independently of llmopt's vectorized implementation; a chi-square test with a
fixed seed compares them with what `sample` draws, and a negative control (a
distribution with one filter left out) must be rejected by the same test. Both samplers
are held to it: the plain one (llmopt/layers/sampler.py) and its CPU tricks
(llmopt/layers/sampler_cpu.py), which must also give the plain one's answers.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from llmopt import SamplingParams
from llmopt.layers import sampler, sampler_cpu
from llmopt.layers.sampler_cpu import filter_logits, greedy_tokens, sample

SAMPLERS = pytest.mark.parametrize("impl", [sampler, sampler_cpu], ids=["plain", "cpu"])

LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])


def expected_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    z = logits.numpy().astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    mass = 0.0  # top-p: the smallest prefix (by probability) whose mass reaches top_p
    for i in order:
        if not keep[i]:
            continue
        if mass >= top_p:
            keep[i] = False
        mass += q[i]
    q = np.where(keep, p, 0)
    q /= q.sum()
    keep &= q >= min_p * q.max()
    q = np.where(keep, q, 0)
    return q / q.sum()


CASES = [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.5, top_k=4),
         dict(top_p=0.7), dict(temperature=0.8, top_k=6, top_p=0.9), dict(min_p=0.2)]


@SAMPLERS
@pytest.mark.parametrize("kw", CASES)
def test_filtered_distribution_equals_definition(kw, impl):
    p = SamplingParams(**kw)
    probs = impl.filter_logits(LOGITS[None], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                          torch.tensor([p.top_p]), torch.tensor([p.min_p])).softmax(-1)[0]
    np.testing.assert_allclose(probs.double().numpy(), expected_probs(LOGITS, **kw), atol=1e-6)


@SAMPLERS
@pytest.mark.parametrize("kw", CASES)
def test_samples_match_distribution_chi_square(kw, impl):
    n = 6000
    params = [SamplingParams(**kw)] * n
    gen = torch.Generator().manual_seed(7)
    draws = impl.sample(LOGITS.repeat(n, 1), params, [gen] * n).numpy()
    want = expected_probs(LOGITS, **kw)
    support = want > 0
    assert not np.isin(np.flatnonzero(~support), draws).any(), "drew a token the filters remove"
    counts = np.bincount(draws, minlength=len(want))[support]
    assert chisquare(counts, want[support] * n).pvalue > 1e-3

    # negative control: the same draws against the unfiltered softmax must be rejected
    if kw.get("top_k", -1) > 0 or kw.get("top_p", 1.0) < 1 or kw.get("min_p", 0) > 0:
        wrong = expected_probs(LOGITS, temperature=kw.get("temperature", 1.0))
        counts_all = np.bincount(draws, minlength=len(want))
        assert chisquare(counts_all + 0.0, wrong * n).pvalue < 1e-6


@SAMPLERS
def test_greedy_is_argmax_and_ignores_generators(impl):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = impl.sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_tokens_equal_torch_argmax(dtype):
    """The fast argmax answers as torch.argmax does: first index on ties, NaN as the largest,
    rows of -inf, inference tensors, one row or many."""
    nan, inf = float("nan"), float("inf")
    special = torch.tensor([[1.0, nan, 3.0, nan], [-inf] * 4, [2.0, 5.0, 5.0, 1.0], [nan] * 4,
                            [inf, 1.0, inf, 0.0], [0.0, -0.0, 0.0, -1.0]])
    with torch.inference_mode():
        for x in (special, torch.randn(7, 49152).round(decimals=1)):  # rounded: many ties
            x = x.to(dtype)
            assert torch.equal(greedy_tokens(x), x.argmax(-1))
            assert greedy_tokens(x[2]).shape == () and int(greedy_tokens(x[2])) == int(x[2].argmax())
    assert torch.equal(greedy_tokens(torch.tensor([[3, 9, 9]])), torch.tensor([1]))  # integers: torch's own


@SAMPLERS
def test_draw_tokens_follows_the_weights_and_never_draws_zero_mass(impl):
    """Inverse-CDF draws: unnormalized weights, zeros at the ends and between, one number per row."""
    weights = torch.tensor([0.0, 3.0, 0.0, 0.0, 1.0, 0.0])
    n = 4000
    draws = impl.draw_tokens(weights.expand(n, -1), [torch.Generator().manual_seed(3)] * n).numpy()
    counts = np.bincount(draws, minlength=6)
    assert counts[[0, 2, 3, 5]].sum() == 0
    assert chisquare(counts[[1, 4]], [0.75 * n, 0.25 * n]).pvalue > 1e-3
    one_hot = torch.zeros(2, 6, dtype=torch.float64)
    one_hot[0, 5], one_hot[1, 0] = 1.0, 1.0  # the last and the first token
    assert impl.draw_tokens(one_hot, [None, None]).tolist() == [5, 0]


@SAMPLERS
def test_per_request_seed_is_independent_of_batch_position(impl):
    logits = torch.zeros(4, 100)
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]  # noqa: E731
    a = impl.sample(logits, [SamplingParams(temperature=1.0)] * 4, gens())
    b = impl.sample(logits[:2], [SamplingParams(temperature=1.0)] * 2, gens()[:2])
    assert a[:2].tolist() == b.tolist()


def test_min_tokens_holds_stop_tokens_back_row_by_row():
    """Row j of a request is its (generated + j)-th output: stop tokens are masked while that is
    below min_tokens; EOS only without ignore_eos; the caller's logits are left as they were."""
    from llmopt.layers.sampler import hold_back_stop_tokens

    logits = torch.randn(7, 12)
    raw = logits.clone()
    rows = [(0, 4, SamplingParams(min_tokens=3, stop_token_ids=[5]), 1),   # 4 rows (drafts), 1 generated
            (4, 1, SamplingParams(min_tokens=3, ignore_eos=True), 0),      # no stop token to hold back
            (5, 1, SamplingParams(min_tokens=2, stop_token_ids=[7]), 2),   # already at min_tokens
            (6, 1, SamplingParams(min_tokens=9, stop_token_ids=[7], ignore_eos=True), 0)]
    out = hold_back_stop_tokens(logits, rows, eos_token_ids={0})
    assert torch.equal(logits, raw)
    held = out == float("-inf")
    assert held[0, [0, 5]].all() and held[1, [0, 5]].all()          # outputs 2 and 3 of 3: held
    assert not held[2:6].any()                                        # output 4, and the others
    assert held[6, 7] and not held[6, 0]                              # EOS ignored, 7 held
    assert held.sum() == 5
    assert hold_back_stop_tokens(logits, rows[1:3], {0}) is logits    # nothing held: no copy


# -- no accepted value can make a draw fail ----------------------------------------------------
@SAMPLERS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-38, 1e-5, 1e-3, 1.0, 1e4])
def test_filter_logits_never_overflows(dtype, temperature, impl):
    """Dividing raw logits by a tiny temperature overflows (float16 at 65504, float32 at 3e38) and
    softmax then gives NaN; with each row's max subtracted first, the best token scores 0."""
    logits = torch.tensor([[30.0, 29.0, -10.0, float("-inf")], [-5.0, 60000.0, 0.0, 1.0]], dtype=dtype)
    n = logits.shape[0]
    out = impl.filter_logits(logits, torch.full((n,), temperature), torch.tensor([2, -1]), torch.tensor([0.9, 1.0]),
                        torch.tensor([0.0, 0.1]))
    probs = out.softmax(-1)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(n))
    assert probs.argmax(-1).tolist() == [0, 1] and probs[0, 3] == 0
    torch.multinomial(probs, 1)  # raises on inf, NaN or negative entries


@SAMPLERS
def test_extreme_accepted_params_sample(impl):
    """Every SamplingParams that validates draws a token: temperatures down to where greedy takes
    over (below 1e-5, as in vLLM) and up to the bound, top_k beyond int64, tiny top_p."""
    from llmopt.sampling_params import GREEDY_TEMPERATURE, MAX_TEMPERATURE

    logits = LOGITS[None] * 1e3
    cases = [dict(temperature=1e-40), dict(temperature=GREEDY_TEMPERATURE), dict(temperature=MAX_TEMPERATURE),
             dict(top_k=2**70), dict(top_p=5e-324), dict(min_p=1.0, temperature=3.0)]
    for kw in cases:
        p = SamplingParams(**kw)
        token = impl.sample(logits, [p], [torch.Generator().manual_seed(0)])
        assert 0 <= int(token) < LOGITS.numel(), kw
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


@pytest.mark.parametrize("top_ks", [(-1, 5, 100), (-1, 5, 1000)])
@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05])  # peaked rows, SmolLM2-like, nearly flat ones
def test_candidate_prefix_filters_as_the_full_sort_does(monkeypatch, scale, top_ks):
    """filter_logits looks at the 128 (then 2,048) largest logits before sorting whole rows; the
    result must be the full sort's, whether the prefix sufficed (peaked rows) or not (flat ones)."""
    sampler = sampler_cpu
    gen = torch.Generator().manual_seed(int(scale * 100))
    B, V = 24, 20000
    logits = torch.randn(B, V, generator=gen) * scale
    pick = lambda options: torch.tensor([options[i % len(options)] for i in range(B)])  # noqa: E731
    knobs = (pick([1.0, 0.7, 1.3]), pick([*top_ks, -1, -1]), pick([1.0, 0.5, 0.9, 0.99, 0.95]),
             pick([0.0, 0.0, 0.01, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    prefixes = []
    keep_sorted = sampler._keep_sorted
    monkeypatch.setattr(sampler, "_keep_sorted", lambda v, *a: prefixes.append(v.shape[-1]) or keep_sorted(v, *a))
    fast = sampler.filter_logits(logits, *knobs)
    monkeypatch.setattr(sampler, "CANDIDATES", ())
    monkeypatch.setattr(sampler, "_keep_sorted", keep_sorted)
    full = sampler.filter_logits(logits, *knobs)
    assert torch.equal(fast.isfinite(), full.isfinite())
    assert torch.equal(fast[fast.isfinite()], full[full.isfinite()])
    assert prefixes[0] == 128 and (max(top_ks) <= 128 or 2048 in prefixes)  # top-k 1,000 waits for 2,048
    if scale == 8.0:
        assert prefixes[-1] < V  # a prefix held every kept token: no full sort
    if scale == 0.05:
        assert prefixes[-1] == V  # flat rows: the nucleus is thousands of tokens, the full sort decides
    unfiltered = torch.nonzero((knobs[1] <= 0) & (knobs[2] >= 1) & (knobs[3] <= 0))[:, 0]
    assert len(unfiltered) and fast[unfiltered].isfinite().all()  # rows that ask for nothing keep every token


def test_token_zero_survives_the_padding_of_shorter_prefixes():
    """Rows finished by a 128-token prefix are padded (id 0, -inf) beside a row that needed a
    longer one; where token 0 is kept, the padding must not mask it."""
    V = 20000
    logits = torch.full((2, V), -30.0)
    logits[0, 0] = 5.0  # row 0: token 0 dominates, its nucleus is 2 tokens
    logits[0, 1] = 4.0
    logits[1] = torch.linspace(0, -3, V)  # row 1: flat, its nucleus needs thousands
    out = filter_logits(logits, torch.ones(2), torch.tensor([-1, -1]), torch.tensor([0.99, 0.9]), torch.zeros(2))
    assert out[0, 0] == 0 and out[0, 1].isfinite() and out[0, 2:].isinf().all()
    assert out[1].isfinite().sum() > 128
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_p=0.99)] * 2, [torch.Generator().manual_seed(0)] * 2)
    assert int(tokens[0]) in (0, 1)


def test_exp_normal_has_no_subnormals_and_keeps_masks_at_zero():
    """Low temperatures push most logits far below the best: their exps would be subnormal floats,
    which x86 computes on a slow path. exp_normal gives those 0, -inf (a mask) 0, the rest exp."""
    from llmopt.layers.sampler_cpu import exp_normal

    x = torch.tensor([[0.0, -1.0, -50.0, -86.9, -87.5, -95.0, -400.0, float("-inf")]])
    y = exp_normal(x)
    assert (y[0, 4:] == 0).all() and (y[0, :4] > 0).all()
    torch.testing.assert_close(y[0, :3], x[0, :3].exp(), rtol=1e-6, atol=0)
    low = (torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)) * 40).clamp(max=0)  # temperature ~0.1
    subnormal = lambda t: ((t > 0) & (t < torch.finfo(torch.float32).tiny)).sum()  # noqa: E731
    assert subnormal(low.exp()) > 100 and subnormal(exp_normal(low)) * 10 < subnormal(low.exp())  # (330 -> 18)
    assert torch.equal(exp_normal(x[:, :3]), x[:, :3].exp())  # nothing that low: plain exp


# -- the CPU tricks give the plain sampler's answers -------------------------------------------------
def _rows_and_knobs(seed: int, B: int = 32, V: int = 20000):
    """Rows at SmolLM2's vocabulary scale, peaked to flat, and every combination of the filters."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=gen) * torch.tensor([8.0, 3.0, 1.0, 0.05]).repeat(B // 4)[:, None]
    pick = lambda options: torch.tensor([options[i % len(options)] for i in range(B)])  # noqa: E731
    return logits, (pick([1.0, 0.7, 1.3, 0.2]), pick([-1, 5, 100, -1, 3000, -1]),
                    pick([1.0, 0.5, 0.9, 0.99, 0.95]), pick([0.0, 0.0, 0.01, 0.2, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cpu_filter_keeps_what_the_plain_filter_keeps(seed):
    """The same tokens kept, at the same filtered logits, row for row (prefixes or full sort)."""
    logits, knobs = _rows_and_knobs(seed)
    plain, fast = sampler.filter_logits(logits, *knobs), sampler_cpu.filter_logits(logits, *knobs)
    assert torch.equal(plain.isfinite(), fast.isfinite())
    assert torch.equal(plain[plain.isfinite()], fast[fast.isfinite()])
    torch.testing.assert_close(sampler_cpu.sampling_probs(logits[:4], SamplingParams(temperature=0.7, top_p=0.9)),
                               sampler.sampling_probs(logits[:4], SamplingParams(temperature=0.7, top_p=0.9)),
                               atol=1e-6, rtol=1e-5)


def assert_same_draws(weights: torch.Tensor, seeds: list[int], plain: torch.Tensor, fast: torch.Tensor):
    """The two draws of rows `weights` with generators seeded `seeds` agree, but where u x total
    lies within rounding of a cumulative boundary: the CPU draw sums chunks of 256 in float32
    (about 1e-7 of the total), the plain one whole rows in float64. Such rows are rare."""
    cdf = weights.double().cumsum(-1)
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in seeds])
    target = u * cdf[:, -1]
    differ = (plain != fast).nonzero()[:, 0].tolist()
    for r in differ:
        edge = cdf[r, min(int(plain[r]), int(fast[r]))]
        assert abs(float(edge - target[r])) <= 1e-5 * float(cdf[r, -1]), f"row {r}: {int(plain[r])} != {int(fast[r])}"
    assert len(differ) <= max(1, len(seeds) // 20)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_cpu_sampler_draws_the_plain_samplers_tokens(seed):
    """Seeded requests draw the same tokens from both samplers: one number per row from its own
    generator, and the first token whose cumulative mass passes it, whether the rows are dense
    or the CPU sampler's candidates. Greedy rows, mixed in, take the same argmax."""
    logits, (temperature, top_k, top_p, min_p) = _rows_and_knobs(seed)
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m))
              for t, k, p, m in zip(temperature, top_k, top_p, min_p)]
    params[3] = SamplingParams(temperature=0.0)
    seeds = [100 + i for i in range(len(params))]
    gens = lambda: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    plain, fast = sampler.sample(logits, params, gens()), sampler_cpu.sample(logits, params, gens())
    assert plain[3] == fast[3] == logits[3].argmax()
    weights = sampler.filter_logits(logits, temperature, top_k, top_p, min_p).exp()
    rows = [i for i in range(len(params)) if i != 3]
    assert_same_draws(weights[rows], [seeds[i] for i in rows], plain[rows], fast[rows])
    weights = torch.rand(64, 49152, generator=torch.Generator().manual_seed(seed)) ** 8
    seeds = [7 + i for i in range(64)]
    g = lambda: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    assert_same_draws(weights, seeds, sampler.draw_tokens(weights, g()), sampler_cpu.draw_tokens(weights, g()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_argmax_is_the_plain_argmax(dtype):
    x = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3)).round(decimals=1).to(dtype)
    x[0, 7] = float("nan")
    assert torch.equal(sampler.greedy_tokens(x), sampler_cpu.greedy_tokens(x))
