"""Rejection sampling over a draft tree: the output keeps exactly the target's distribution.

A chain offers one guess per position; a tree offers several siblings. EAGLE-2 picks them
deterministically (the head's top-k), so each sibling is a one-hot proposal, and the rule for
one-hot drafts (llmopt/spec/rejection_sampler.py) extends to several of them in turn
(recursive rejection sampling, as SpecInfer and EAGLE verify trees). At a node whose target
distribution is p, try its children x_1, x_2, ... in order:

- accept x_i with probability p(x_i), then continue from that child's own distribution;
- on rejection, remove x_i: p <- norm(p with p(x_i) = 0), and try the next sibling;
- when every sibling is rejected (or the node is a leaf), draw from what is left of p and stop.

The token emitted at a node is x_1 with probability p(x_1), x_2 with (1 - p(x_1)) * p(x_2) /
(1 - p(x_1)) = p(x_2), ..., anything else with its own p: exactly p, whatever the tree. Greedy
decoding is the limit of one-hot p: follow the child that is the target's argmax while there
is one, then emit the argmax.
"""

from __future__ import annotations

import torch

from llmopt.layers.sampler_cpu import draw_token, greedy_tokens


def tree_rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int], parents: list[int],
                          generator: torch.Generator | None = None, greedy: bool = False) -> tuple[list[int], list[int]]:
    """One sequence's tree. target_probs [n + 1, V]: row 0 for the root (the last committed
    token), row i + 1 for node i; draft_tokens[i], parents[i] (-1 = the root) describe node i,
    siblings in the order they are tried. Returns (emitted tokens, accepted node indices):
    the tokens of the accepted path plus one more."""
    n = len(draft_tokens)
    if target_probs.shape[0] != n + 1 or len(parents) != n:
        raise ValueError(f"a tree of {n} nodes needs {n + 1} target rows and {n} parents, got "
                         f"{target_probs.shape[0]} rows and {len(parents)} parents")
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    node, path, out = -1, [], []
    while True:
        p = target_probs[node + 1]
        if greedy:
            best = int(greedy_tokens(p))
            nxt = next((c for c in children.get(node, []) if draft_tokens[c] == best), None)
            if nxt is None:
                return out + [best], path
        else:
            p, nxt = p.double(), None
            for child in children.get(node, []):
                x = draft_tokens[child]
                total = float(p.sum())
                u = torch.rand((), generator=generator, device=p.device).item()
                if total > 0 and u * total < float(p[x]):
                    nxt = child
                    break
                p = p.clone()
                p[x] = 0.0  # rejected: the residual max(0, p - onehot(x)), renormalized on use
            if nxt is None:
                if float(p.sum()) <= 0:  # all mass on rejected siblings: probability 0; guard rounding
                    p = target_probs[node + 1].double()
                return out + [draw_token(p, generator)], path
        out.append(draft_tokens[nxt])
        path.append(nxt)
        node = nxt
