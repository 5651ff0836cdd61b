"""Lesson 05's exercise: speculative sampling's accept/resample rule at one draft position.

The learner writes the rule: accept the draft token x when u < min(1, p(x) / q(x)), else return
the distribution the replacement is drawn from, max(0, p - q) (normalized or not). `sampler_from`
walks a draft with it exactly as the engine's `rejection_sample` does (the same random draws, in
the same order), so the check can demand the engine's very tokens on seeded cases, and the live
run can put the learner's rule inside the engine's model runner as its verifier.
"""

from __future__ import annotations

import torch

from llmopt.exercises.base import Case, Exercise
from llmopt.layers.sampler_cpu import draw_token
from llmopt.spec.rejection_sampler import rejection_sample


def accept_or_resample_solution(p: torch.Tensor, q: torch.Tensor, x: int, u: float) -> torch.Tensor | None:
    """p: the target's distribution, q: the draft's, x: the draft token, u: a uniform draw in [0, 1).
    None accepts x; otherwise the distribution to draw the replacement from."""
    if q[x] > 0 and u < min(1.0, float(p[x] / q[x])):
        return None
    return (p - q).clamp_min(0)


def sampler_from(rule):
    """A verifier with `rejection_sample`'s signature that decides each position with `rule`."""
    def verify(target_probs, draft_probs, draft_tokens, generator=None, greedy=False) -> list[int]:
        if greedy:  # greedy is argmax matching, not the rule: the engine's own
            return rejection_sample(target_probs, draft_probs, draft_tokens, generator, greedy=True)
        out = []
        for i, x in enumerate(draft_tokens.tolist()):
            p = target_probs[i]
            q = torch.zeros_like(p).index_fill_(0, torch.tensor([x]), 1.0) if draft_probs is None else draft_probs[i]
            u = torch.rand((), generator=generator, device=p.device).item()
            residual = rule(p, q, x, u)
            if residual is None:
                out.append(x)
                continue
            residual = torch.as_tensor(residual, dtype=p.dtype, device=p.device)
            if float(residual.sum()) <= 0:  # p == q: rejection had probability 0 (rounding); as the engine does
                residual = p
            return out + [draw_token(residual / residual.sum(), generator)]
        return out + [draw_token(target_probs[len(out)], generator)]
    return verify


def _case(seed: int, vocab: int, k: int, one_hot: bool) -> Case:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(k + 1, vocab, generator=g), -1)
    q = None if one_hot else torch.softmax(2 * torch.randn(k, vocab, generator=g), -1)
    drafts = torch.multinomial(p[:k] if one_hot else q, 1, generator=g)[:, 0]
    expected = rejection_sample(p, q, drafts, torch.Generator().manual_seed(seed))

    def call(fn):
        return sampler_from(fn)(p, q, drafts, torch.Generator().manual_seed(seed))

    return Case({"seed": seed, "draft_tokens": drafts.tolist(), "target_probs": p,
                 "draft_probs": "one-hot (n-gram drafts)" if one_hot else q},
                expected, call, note="the tokens emitted for this draft, with the engine's random draws")


def cases():
    for seed in range(60):
        yield _case(seed, vocab=6, k=3, one_hot=seed % 5 == 4)


def live(fn) -> str:
    """`tiny` speculating with `tiny-draft` (k = 3), sampled at temperature 0.8 with a seed: once
    with the engine's verifier, once with a verifier built on `fn`; the same random draws, so the
    same rule must give the same tokens."""
    from llmopt import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", speculative_config={"method": "draft_model", "model": "tiny-draft",
                                                         "num_speculative_tokens": 3},
              enforce_eager=True)
    prompts = ["def add(a, b):", "for i in range(10):"]
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=1, ignore_eos=True)
    engine = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats_before = dict(llm.llm_engine.spec_stats)
    runner = llm.llm_engine.runner
    runner.rejection_sampler = sampler_from(fn)
    try:
        yours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del runner.rejection_sampler
    s = llm.llm_engine.spec_stats
    drafted = s["num_draft_tokens"] - stats_before["num_draft_tokens"]
    accepted = s["num_accepted_tokens"] - stats_before["num_accepted_tokens"]
    same = [list(a) == list(b) for a, b in zip(yours, engine)]
    return (f"your verifier inside the engine: {accepted} of {drafted} draft tokens accepted "
            f"({accepted / max(drafted, 1):.0%}); sampled tokens "
            + ("identical to the engine's verifier's" if all(same) else "NOT the engine's") + " for "
            + " and ".join(repr(p) for p in prompts) + f"\n{llm.tokenizer.decode(yours[0])!r}")


EXERCISE = Exercise("speculative_accept_resample", 5, "accept a draft token or resample, so the output is the target's",
                    cases, accept_or_resample_solution, live)
