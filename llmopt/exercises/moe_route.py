"""Lesson 10's exercise: DeepSeek-V3's mixture-of-experts routing, from router logits to each
token's top-k experts and their weights.

Every expert is scored with a sigmoid; the choice adds the per-expert load-balancing bias, keeps
only the `topk_group` best groups (a group scored by its two best experts) and takes the top k
there; the weights are the chosen experts' unbiased scores, normalised to sum to 1 where
`norm_topk_prob` says so, times `routed_scaling_factor`. The check holds the learner's function
against the engine's `route` (llmopt/layers/moe.py); the live run routes every MoE layer of the
lesson's DeepSeek-shaped model through it and compares the greedy tokens with the engine's.
"""

from __future__ import annotations

import torch

from llmopt.exercises.base import Case, Exercise
from llmopt.layers import moe
from llmopt.layers.moe import MoEConfig


def route_solution(logits: torch.Tensor, bias: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32), bias [E], cfg (a MoEConfig) -> (expert ids [T, k] int64,
    their weights [T, k] float32)."""
    scores = logits.sigmoid()            # each expert scored alone: no softmax across experts
    choice = scores + bias               # the bias steers which experts are chosen, never their weight
    T, E, G = logits.shape[0], cfg.n_routed_experts, cfg.n_group
    group_scores = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)      # [T, G]
    best_groups = group_scores.topk(cfg.topk_group, dim=-1).indices
    allowed = torch.zeros(T, G, dtype=torch.bool, device=logits.device).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


def by_expert(result):
    """(ids, weights) with each token's experts in ascending order. The engine's top-k is unsorted,
    so any order of a token's k experts is right, as long as each weight stays with its expert."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and all(isinstance(t, torch.Tensor) for t in result) and result[0].shape == result[1].shape):
        return result   # compared as it is: the report shows what came back
    ids, weights = result
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


def config(experts: int, k: int, groups: int = 1, topk_group: int = 1, norm: bool = True,
           scale: float = 1.0) -> MoEConfig:
    """The routing fields of a MoEConfig (the experts' sizes do not matter here)."""
    return MoEConfig(n_routed_experts=experts, num_experts_per_tok=k, moe_intermediate_size=16,
                     n_shared_experts=0, n_group=groups, topk_group=topk_group, norm_topk_prob=norm,
                     routed_scaling_factor=scale, first_k_dense_replace=0)


def _random(seed: int, tokens: int, experts: int, bias_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g) * 2, torch.randn(experts, generator=g) * bias_scale


T = torch.tensor
# The lesson's model routes so: 8 experts in 4 groups, the best 2 groups, top 2, normalised, x 2.5.
LESSON = config(8, 2, groups=4, topk_group=2, norm=True, scale=2.5)
CASES = [  # (logits [T, E], bias [E], cfg, note)
    (T([[0.5, 2.0, -1.0, 0.0], [-3.0, -2.0, -2.5, -1.0], [1.0, 0.9, 1.1, 0.2]]), torch.zeros(4),
     config(4, 1, norm=False), "top_k = 1, no normalisation: the weight is the expert's sigmoid"),
    (T([[0.5, 2.0, -1.0, 0.0], [-3.0, -2.0, -2.5, -1.0], [1.0, 0.9, 1.1, 0.2]]), torch.zeros(4),
     config(4, 2, norm=True), "top 2, normalised: each token's weights sum to 1"),
    (T([[1.5, 1.5, -1.0, 0.0], [0.0, 2.0, 2.0, 2.0]]), torch.zeros(4),
     config(4, 2), "a tie between chosen experts: equal weights"),
    (T([[2.0, 1.0, -2.0, 0.5], [0.0, 0.3, -1.0, 0.2]]), T([0.0, 0.0, 3.0, 0.0]),
     config(4, 2), "the bias picks expert 2; its weight is its own score, without the bias"),
    # token 0: expert 0 is the best, but its group (0, 1) scores lower than groups (4, 5) and (6, 7)
    (T([[3.0, -4.0, 0.0, 0.1, 2.0, 1.9, 1.8, 1.7], [0.1, 0.2, 2.0, 1.0, -1.0, 0.3, 0.4, 0.5]]), torch.zeros(8),
     config(8, 2, groups=4, topk_group=2), "only the best groups' experts: a group counts its two best"),
    (*_random(5, 6, 8, 0.1), LESSON, "the lesson model's routing: 4 groups, top 2, x 2.5"),
    (*_random(6, 6, 8, 0.1), config(8, 2, groups=4, topk_group=2, norm=False, scale=2.5),
     "not normalised, then scaled"),
    (*_random(7, 4, 8, 0.5), config(8, 4, groups=4, topk_group=2),
     "k = every expert of the 2 chosen groups"),
    (*_random(8, 32, 16, 0.3), config(16, 4, groups=4, topk_group=2, scale=1.5), "32 tokens, 16 experts, top 4"),
]


def cases():
    for logits, bias, cfg, note in CASES:
        yield Case({"logits": logits, "bias": bias, "cfg": cfg}, by_expert(moe.route(logits, bias, cfg)),
                   lambda fn, x=logits, b=bias, c=cfg: by_expert(fn(x.clone(), b.clone(), c)), note=note)


def live(fn, folder=None) -> str:
    """The lesson's DeepSeek-shaped model (random weights; `folder`: the one the lesson wrote, else
    written here) generating greedily with every MoE layer routed by `fn`, against the engine's route."""
    import tempfile

    from llmopt import LLM, SamplingParams, model_path
    from llmopt.viz.frontier import write_zoo

    if folder is None:
        folder = write_zoo(tempfile.mkdtemp(prefix="llmopt-moe-"), model_path("tiny"), names=["MLA"])["MLA"]
    llm = LLM(model=str(folder), device="cpu", block_size=16, num_kv_blocks=64, enforce_eager=True)
    cfg = llm.llm_engine.model.config.moe
    prompts = ["def add(a, b):", "The capital of France", "import numpy as np\n"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    counts = {}

    def counted(route, who):
        counts[who] = torch.zeros(cfg.n_routed_experts, dtype=torch.long)

        def routed(logits, bias, c):
            ids, weights = route(logits, bias, c)
            counts[who] += torch.bincount(torch.as_tensor(ids).flatten().long(), minlength=c.n_routed_experts)
            return ids, weights
        return routed

    engine_route = moe.route
    try:  # MoE.forward calls the module's `route`: swapped here, put back whatever happens
        moe.route = counted(engine_route, "engine")
        engine = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        moe.route = counted(fn, "yours")
        yours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        moe.route = engine_route
    layers = sorted(llm.llm_engine.model.moe_layers())
    lines = [f"every MoE layer ({', '.join(map(str, layers))}) of the lesson's model routed by your function: "
             f"{cfg.n_routed_experts} experts in {cfg.n_group} groups, the best {cfg.topk_group} groups, "
             f"top {cfg.num_experts_per_tok}",
             f"(token, expert) pairs per expert over the run, all layers: yours {counts['yours'].tolist()}, "
             f"the engine's {counts['engine'].tolist()}"]
    lines += [f"{'same' if y == e else 'DIFFERENT'}: {p!r} -> {y}" for p, y, e in zip(prompts, yours, engine)]
    lines.append("greedy tokens equal to the engine's own routing" if yours == engine
                 else "greedy tokens differ from the engine's own routing")
    return "\n".join(lines)


EXERCISE = Exercise("moe_routing", 10, "route each token to its top-k experts and weight them, as DeepSeek-V3 does",
                    cases, route_solution, live)
