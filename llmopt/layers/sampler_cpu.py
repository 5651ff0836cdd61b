"""The sampler's speed tricks for a CPU's shapes: llmopt/layers/sampler.py's answers, faster.

Each function here has the plain one of the same name beside it in llmopt/layers/sampler.py,
and the tests hold each pair equal (the same tokens, the same filtered logits). An engine
picks this file unless `enforce_eager=True` (`choose_step_backend`); speculative decoding's
samplers and proposers always draw through it. What each trick buys was measured on SmolLM2's
49,152-token rows (benchmarks/README.md, "Measurements behind the code's choices"):

- `greedy_tokens`: numpy's vectorized argmax, where torch.argmax on the CPU is a scalar loop;
- `draw_tokens`: a two-level inverse CDF (sums of 256, then one chunk), where a float64 cumsum
  of whole rows (and torch.multinomial) costs a large share of a decode step;
- `exp_normal`: exp without subnormal floats, which x86 computes on a slow path and a low
  temperature makes of most of a row's exponentials;
- `filter_logits`: the 128 (then 2,048) largest logits tried before sorting whole rows, since
  a nucleus is usually a few dozen tokens.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from llmopt.layers.sampler import knobs

# Tokens per chunk of the two-level inverse CDF in draw_tokens.
CHUNK = 256
# exp(-87): the smallest exp that is still a normal float32 (subnormals start below exp(-87.3)).
EXP_FLOOR = math.exp(-87.0)
# Candidate prefixes tried before sorting whole rows. A row's prefix is enough when the token after
# it would be dropped anyway; the rows where it is not (flat ones) try the next, and last the full sort.
CANDIDATES = (128, 2048)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax's answer ([..., V] -> [...], int64: the first index on ties, NaN counting as
    the largest), from numpy's argmax on CPU tensors."""
    if logits.device.type != "cpu" or logits.requires_grad or not logits.is_floating_point():
        return logits.argmax(-1)
    rows = logits.detach()
    if rows.dtype not in (torch.float32, torch.float64):
        rows = rows.float()  # bfloat16 / float16 widen exactly: the same order, the same ties
    return torch.from_numpy(np.asarray(rows.numpy().argmax(-1)))


def draw_tokens(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """The plain draw_tokens (one uniform u per row from its generator; the first token whose
    cumulative probability passes u x the row's total), in two levels: sums of 256 tokens, their
    float64 cumulative sum, then the cumulative sum inside the one chunk u lands in. Each
    probability is read once, and no whole row is widened to float64."""
    dev, (n, V) = probs.device, probs.shape
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=dev) for g in generators])
    probs = probs if probs.dtype in (torch.float32, torch.float64) else probs.float()
    chunks = (probs if V % CHUNK == 0 else torch.nn.functional.pad(probs, (0, -V % CHUNK))).reshape(n, -1, CHUNK)
    outer = chunks.sum(-1).double().cumsum(-1)  # mass up to each chunk's end
    target = u * outer[:, -1]
    c = torch.searchsorted(outer, target[:, None], right=True)[:, 0].clamp_(max=outer.shape[1] - 1)
    before = torch.nn.functional.pad(outer, (1, 0)).gather(-1, c[:, None])[:, 0]  # mass before chunk c
    inner = chunks[torch.arange(n, device=dev), c].double().cumsum(-1)   # within the chosen chunk
    # the chunk has mass (its cumulative sum rose past the target); a rounding step between its two
    # sums must not carry the pick past its last token of mass
    rest = torch.minimum(target - before, inner[:, -1] * (1 - 2**-40))
    i = torch.searchsorted(inner, rest[:, None], right=True)[:, 0]
    return (c * CHUNK + i).clamp_(max=V - 1)


def draw_token(probs: torch.Tensor, generator=None) -> int:
    """`draw_tokens` for one distribution [V]."""
    return int(draw_tokens(probs[None], [generator])[0])


def exp_normal(x: torch.Tensor) -> torch.Tensor:
    """exp of logits whose best is 0, without the mass of subnormal floats: exp(max(x, -87)) -
    exp(-87), so a token below -87 (or at -inf: a mask) gets exactly 0 and every other loses
    1.6e-38 (only those just above -87 can still come out subnormal). It costs the same at any
    temperature."""
    if x.numel() == 0 or bool(x.amin() >= -87.0):  # (a trained model at temperature ~1: no tail that far)
        return x.exp()
    return x.clamp(min=-87.0).exp_().sub_(EXP_FLOOR)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The plain filter_logits (float32 rows, each row's best at 0, dropped tokens at -inf)."""
    values, order = filtered_candidates(logits, temperature, top_k, top_p, min_p)
    return values if order is None else _dense(values, order, logits.shape[-1])


def _dense(values: torch.Tensor, order: torch.Tensor, V: int) -> torch.Tensor:
    """Candidates back to rows of V logits. The largest of duplicates wins: a padding entry
    (id 0, -inf) must not overwrite token 0 where it was kept."""
    return torch.full((len(values), V), float("-inf"), device=values.device).scatter_reduce_(
        -1, order, values, reduce="amax")


def filtered_candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """filter_logits, sparse: (values [B, C], token ids [B, C]) holding every kept token of each row
    (-inf where dropped; id 0 pads a row whose prefix was shorter than C), or (the dense rows,
    None) when no row filters. A draw over the C candidates is a draw over the filtered row."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)).div_(temperature.float()[:, None])  # (amax: faster than max)
    B, V = logits.shape
    k = torch.where(top_k <= 0, V, top_k.clamp(max=V))
    active = (k < V) | (top_p < 1) | (min_p > 0)
    if not bool(active.any()):
        return logits, None
    # each row's probabilities are over its top-k tokens, or over the whole row where top-k is off
    # (its best logit is 0, so the sum of exps cannot overflow)
    whole = torch.full((B,), float("nan"), device=logits.device)
    need = (active & (k >= V)).nonzero()[:, 0]
    if len(need):
        whole[need] = exp_normal(logits if len(need) == B else logits[need]).sum(-1).log()
    pieces, left = [], active.clone()
    for c in [c for c in CANDIDATES if c < V // 4] + [V]:
        # a top-k beyond the prefix waits for a longer one: its normalizer needs tokens outside
        now = (left & ~((k > c) & (k < V))).nonzero()[:, 0] if c < V else left.nonzero()[:, 0]
        if not len(now):
            continue
        x = logits if len(now) == B else logits[now]
        values, order = x.topk(c, dim=-1) if c < V else x.sort(dim=-1, descending=True)
        kept, enough = _keep_sorted(values, k[now], top_p[now], min_p[now], whole[now])
        done = enough if c < V else torch.ones_like(enough)
        pieces.append((now[done], kept[done], order[done]))
        left[now[done]] = False
        if not bool(left.any()):
            break
    plain = (~active).nonzero()[:, 0]  # rows that filter nothing: every token, in vocabulary order
    if len(plain):
        pieces.append((plain, logits[plain], torch.arange(V, device=logits.device).expand(len(plain), V)))
    C = max(v.shape[-1] for _, v, _ in pieces)
    values = torch.full((B, C), float("-inf"), device=logits.device)
    order = torch.zeros((B, C), dtype=torch.long, device=logits.device)
    for rows, v, o in pieces:
        values[rows, :v.shape[-1]] = v
        order[rows, :o.shape[-1]] = o
    return values, order


def _keep_sorted(values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C largest logits of each row, sorted (`whole`: the log of each row's sum of exps, NaN
    where top-k is on) -> those values with the dropped ones at -inf, and whether the prefix held
    every token kept."""
    C = values.shape[-1]
    drop = torch.arange(C, device=values.device)[None, :] >= k[:, None]
    values = values.masked_fill(drop, float("-inf"))
    norm = torch.where(whole.isnan(), values.logsumexp(-1), whole)  # top-k on: it lies in the prefix
    probs = (values - norm[:, None]).exp()
    mass = probs.cumsum(-1)
    # top-p keeps token i while the mass strictly before it is still < top_p (1: off, whatever the rounding)
    drop |= ((mass - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    # token C, the first outside, would go: beyond top-k, past top-p's mass, or below min-p
    enough = (k <= C) | ((top_p < 1) & (mass[:, -1] >= top_p)) | (probs[:, -1] < min_p * probs[:, 0])
    return values.masked_fill(drop, float("-inf")), enough


def sampling_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The plain sampling_probs: one-hot on the argmax when greedy, else the filtered softmax."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).to(logits.dtype)
    p = exp_normal(filter_logits(logits, *knobs([params] * logits.shape[0], logits)))  # softmax, without subnormals
    return p / p.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]) -> torch.Tensor:
    """The plain sample: one token per row, greedy rows the argmax; the draws over each row's
    candidates only (in vocabulary order, so the draw is the one a dense row gives)."""
    out = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:  # step choice: sampler tier (greedy only, or draws)
        return out
    sampled = logits if len(rows) == len(params) else logits[rows]
    values, order = filtered_candidates(sampled, *knobs([params[i] for i in rows], logits))
    if order is not None and values.shape[-1] == logits.shape[-1]:  # a full sort: back to dense rows
        values, order = _dense(values, order, logits.shape[-1]), None
    elif order is not None:  # the candidates in vocabulary order: the draw a dense row would give
        order, by_id = order.sort(-1)
        values = values.gather(-1, by_id)
    picks = draw_tokens(exp_normal(values), [generators[i] for i in rows])  # best logit 0: unnormalized
    out[rows] = (picks if order is None else order.gather(-1, picks[:, None])[:, 0]).to(out.device)
    return out
