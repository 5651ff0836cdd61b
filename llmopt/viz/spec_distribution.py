"""Why speculative decoding's output is still the target's: one-token speculation sampled many
times, its first tokens counted against the target's distribution p and the draft's q.

The engine's rejection sampler should reproduce p exactly, whatever the draft proposes; a broken
verifier that keeps every draft (`always_accept`, the negative control) reproduces q instead.
Pearson's chi-square test tells the two apart, and the bars show it.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from llmopt.spec.rejection_sampler import rejection_sample
from llmopt.viz.notebook import LEGEND_BELOW
from llmopt.viz.spec import show_token


def always_accept(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                  generator: torch.Generator | None = None, greedy: bool = False) -> list[int]:
    """A broken verifier, the negative control: keeps every draft, then samples a bonus token.
    Its tokens follow the draft's distribution q, not the target's p."""
    bonus = target_probs[draft_tokens.shape[0]]
    return draft_tokens.tolist() + [int(bonus.argmax() if greedy else
                                        torch.multinomial(bonus, 1, generator=generator))]


def first_token_counts(p: torch.Tensor, q: torch.Tensor, n: int, seed: int = 0,
                       sampler=rejection_sample) -> tuple[torch.Tensor, int]:
    """n rounds of one-token speculation: draw x ~ q, let `sampler` verify it against p.
    Returns how often each token came out first (a tensor [V]) and how many drafts were accepted."""
    if p.ndim != 1 or p.shape != q.shape:
        raise ValueError(f"p and q must be 1-d distributions over the same vocabulary, got {tuple(p.shape)} "
                         f"and {tuple(q.shape)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    target = torch.stack([p, p])  # position 1's distribution, and the bonus position's
    counts = torch.zeros_like(p, dtype=torch.long)
    accepted = 0
    for x in drafts:
        emitted = sampler(target, q[None], x[None], generator=g)
        counts[emitted[0]] += 1
        accepted += len(emitted) == 2  # k = 1: the draft and a bonus token
    return counts, accepted


def top_bins(p: torch.Tensor, q: torch.Tensor, top: int = 8) -> list[int]:
    """The tokens worth a bar: the `top` most likely under p and under q, most likely (by p) first."""
    ids = set(p.topk(top).indices.tolist()) | set(q.topk(top).indices.tolist())
    return sorted(ids, key=lambda i: -float(p[i]))


def binned(probs_or_counts: torch.Tensor, bins: list[int]) -> list[float]:
    """Values at `bins`, then everything else summed in one last bin."""
    v = probs_or_counts.double()
    inside = [float(v[i]) for i in bins]
    return inside + [float(v.sum()) - sum(inside)]


def chi_square(counts: torch.Tensor, probs: torch.Tensor, bins: list[int]) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of `counts` against `probs`, over `bins` plus the rest:
    (statistic, degrees of freedom, p-value). A tiny p-value says the samples do not follow probs."""
    observed = torch.tensor(binned(counts, bins), dtype=torch.float64)
    expected = torch.tensor(binned(probs, bins), dtype=torch.float64) * observed.sum()
    if bool(((expected == 0) & (observed > 0)).any()):
        return float("inf"), len(bins), 0.0  # a token the target never emits was emitted
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, pvalue


def distribution_rows(p: torch.Tensor, q: torch.Tensor, counts: dict[str, torch.Tensor], bins: list[int],
                      tokenizer=None) -> list[dict]:
    """One row per bin: the target's p, the draft's q, and the share of each sampler's tokens."""
    labels = [repr(show_token(tokenizer, i)) for i in bins] + ["(all other tokens)"]
    columns = {"p (target)": binned(p, bins), "q (draft)": binned(q, bins)}
    for name, c in counts.items():
        columns[name] = [v / float(c.sum()) for v in binned(c, bins)]
    ids = [*bins, None]
    return [{"token_id": ids[j], "token": labels[j], **{name: col[j] for name, col in columns.items()}}
            for j in range(len(labels))]


def distribution_figure(rows: list[dict], title: str = "") -> go.Figure:
    """Bars per token: the target's p, the draft's q and each sampler's output frequencies."""
    names = [c for c in rows[0] if c not in ("token_id", "token")]
    colors = ["#1f77b4", "#bbbbbb", "#2ca02c", "#d62728", "#9467bd"]
    fig = go.Figure([go.Bar(x=[r["token"] for r in rows], y=[round(r[name], 5) for r in rows], name=name,
                            marker_color=color) for name, color in zip(names, colors)])
    fig.update_layout(barmode="group", title=title, height=410, margin=dict(l=50, r=10, t=40, b=110),
                      yaxis_title="probability / frequency", legend=LEGEND_BELOW)
    return fig
