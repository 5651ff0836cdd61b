"""Mixture of experts, as DeepSeek-V3 routes it: each token runs only k of E small MLPs.

The router scores every expert with a sigmoid. For the *choice* it adds a per-expert bias
(DeepSeek-V3's auxiliary-loss-free load balancing: training nudges the bias of overloaded
experts down), restricts the choice to the `topk_group` best groups of experts (a group is
scored by its two best experts: on a cluster a group lives on one node, so a token's
traffic reaches few nodes), and takes the top k there. The *weights* are the unbiased
sigmoid scores of the chosen experts, normalised to sum to 1 and times routed_scaling_factor.
Shared experts run on every token, beside the routed ones.

Execution is grouped by expert, as vLLM's fused MoE and every serving engine do it: the
step's (token, expert) pairs are sorted by expert, and each expert that got any token runs
one matmul over all of them, instead of one small matmul per token and expert. The counts
per expert are kept (`last_counts`, `last_topk`) so the engine's trace can show routing
and load imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEConfig:
    """DeepSeek-V3's mixture of experts: sigmoid router, bias-corrected grouped top-k."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int  # the first layers keep a dense MLP


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (top-k expert ids [T, k], their weights [T, k])."""
    scores = logits.sigmoid()
    choice = scores + bias
    T, E, G = scores.shape[0], cfg.n_routed_experts, cfg.n_group
    group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)          # [T, G]
    best_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    topk = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, topk)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk, weights * cfg.routed_scaling_factor


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        self.gate = nn.Linear(hidden, E, bias=False)             # the router
        # the load-balancing bias: a checkpoint tensor, so a (frozen) parameter the loader fills
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)
        # Expert weights stacked [E, ...]: the loader splices experts.{e}.gate_proj/up_proj/down_proj in.
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, hidden))  # gate and up, fused
        self.w2 = nn.Parameter(torch.empty(E, hidden, inter))       # down
        self.shared_experts = SwiGLU(hidden, inter * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.last_counts: torch.Tensor | None = None  # tokens per expert in the last forward
        self.last_topk: torch.Tensor | None = None    # [T, k] experts chosen per token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the router runs in fp32 whatever the model's dtype (as DeepSeek keeps it)
        logits = F.linear(x.float(), self.gate.weight.float())
        topk, weights = route(logits, self.gate.e_score_correction_bias.float(), self.cfg)
        self.last_topk = topk
        out = self.experts(x, topk, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def experts(self, x: torch.Tensor, topk: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Grouped by expert: sort the (token, expert) pairs by expert, one matmul per active expert."""
        k = topk.shape[1]
        flat = topk.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.n_routed_experts)
        self.last_counts = counts
        token_of = order // k                                   # pair -> its token
        xs = x[token_of]                                        # tokens, expert by expert
        w = weights.flatten()[order].to(x.dtype)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue  # an idle expert costs nothing this step
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * w[rows]
            out.index_add_(0, token_of[rows], y)
            start += n
        return out


def load_imbalance(counts: torch.Tensor) -> float:
    """Busiest expert's tokens over the mean (1.0 = perfectly even): the step waits for the busiest."""
    mean = counts.float().mean()
    return float(counts.max() / mean) if mean > 0 else 1.0


def moe_step_stats(model) -> dict:
    """The last forward's routing, for the engine's trace: per MoE layer, tokens per expert,
    load imbalance, and the experts each token of the flat batch went to ({} for dense models)."""
    layers = model.moe_layers() if hasattr(model, "moe_layers") else {}
    done = {i: m for i, m in layers.items() if m.last_counts is not None}
    if not done:
        return {}
    return {"moe": {"tokens_per_expert": {i: m.last_counts.tolist() for i, m in done.items()},
                    "load_imbalance": {i: load_imbalance(m.last_counts) for i, m in done.items()},
                    "expert_ids": {i: m.last_topk.tolist() for i, m in done.items()}}}
