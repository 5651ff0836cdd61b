"""Speculative sampling's accept/reject rule, which makes the output exactly the target's.

A proposer drew tokens x_1..x_k from its distributions q_1..q_k; one target forward gave
p_1..p_{k+1} at the same positions (after the same temperature / top-k / top-p, so both
sides describe the distributions actually sampled from). Walk the proposals in order:

- accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
- at the first rejection, draw the replacement from norm(max(0, p_i - q_i)) and stop;
- if all k are accepted, draw one bonus token from p_{k+1}.

Each emitted token is then distributed exactly as p (Leviathan et al., 2023; Chen et al.,
2023): speculation changes how many target forwards a token costs, never what is sampled.
Greedy decoding is the limit where p and q are one-hot on their argmaxes: accept while the
draft token is the target's argmax, then emit the target's argmax. An n-gram proposer's q
is one-hot on its guess, so its acceptance probability is just p_i(x_i).
"""

from __future__ import annotations

import torch

from llmopt.layers.sampler_cpu import draw_token, greedy_tokens


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_tokens: torch.Tensor, generator: torch.Generator | None = None,
                     greedy: bool = False) -> list[int]:
    """One sequence. target_probs [k+1, V]; draft_probs [k, V] (None = one-hot drafts, as from
    n-gram lookup); draft_tokens [k]. Returns the emitted tokens: the accepted prefix of the
    draft plus one more (the replacement at the first rejection, or the bonus token)."""
    k = draft_tokens.shape[0]
    out: list[int] = []
    for i in range(k):
        x = int(draft_tokens[i])
        p = target_probs[i]
        if greedy:
            best = int(greedy_tokens(p))
            if best != x:
                return out + [best]
            out.append(x)
            continue
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = torch.rand((), generator=generator, device=p.device).item()
        if q_x > 0 and u < min(1.0, float(p[x]) / q_x):
            out.append(x)
            continue
        # rejected: the residual max(0, p - q) holds exactly the mass the draft under-proposed
        q = torch.zeros_like(p) if draft_probs is None else draft_probs[i]
        if draft_probs is None:
            q[x] = 1.0
        residual = (p - q).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0; guard rounding
            residual = p
        out.append(draw_token(residual / residual.sum(), generator))
        return out
    bonus = target_probs[k]
    if greedy:
        return out + [int(greedy_tokens(bonus))]
    return out + [draw_token(bonus, generator)]
