"""Turn logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Order, as in vLLM: divide by temperature; keep the k most likely tokens; keep the
smallest set whose probability reaches top_p; drop tokens below min_p x the top
probability; renormalize and draw. Each request may bring its own seeded generator,
so its samples do not depend on what else is in the batch.

No accepted parameter can make a draw fail: the division happens in float32 after each row's
maximum is subtracted, so the best token scores 0 and every other one is <= 0 (-inf at worst,
probability 0), never the inf - inf = NaN that a tiny temperature gives a raw division.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit ([..., V] -> [...], int64): torch.argmax's answer,
    the first index on ties, NaN counting as the largest, as numpy's argmax gives it.

    Why not torch.argmax: on the CPU it is a scalar loop, far slower than numpy's vectorized
    argmax over a row of SmolLM2's 49,152 logits and a visible share of a decode step at many
    sequences, and a speculative step's verification asks for it once per position.
    (measured: benchmarks/README.md, "Measurements behind the code's choices")"""
    if logits.device.type != "cpu" or logits.requires_grad or not logits.is_floating_point():  # step choice: argmax
        return logits.argmax(-1)
    rows = logits.detach()
    if rows.dtype not in (torch.float32, torch.float64):
        rows = rows.float()  # bfloat16 / float16 widen exactly: the same order, the same ties
    return torch.from_numpy(np.asarray(rows.numpy().argmax(-1)))


# Tokens per chunk of the two-level inverse CDF in draw_tokens.
CHUNK = 256


def draw_tokens(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One token per row of `probs` [n, V] (unnormalized is fine), row i drawn with generators[i]
    (None: torch's global generator): one uniform u per row, and the first token whose cumulative
    probability passes u x the row's total (inverse-CDF sampling). A token of probability 0 is never
    drawn, and each row takes exactly one number from its own generator, so a seeded request draws
    the same tokens wherever it sits in the batch.

    Why not torch.multinomial: on the CPU, for rows of SmolLM2's 49,152 probabilities, it costs a
    large share of a Q8_0 decode step at batch 1 and more than the step's forward at many rows.
    And why two levels: a float64 cumulative sum over whole rows is slow (the widening copy and the
    sequential sum); summing chunks of 256 first, then one chunk's 256, reads each probability once.
    (measured: benchmarks/README.md, "Measurements behind the code's choices")"""
    dev, (n, V) = probs.device, probs.shape
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=dev) for g in generators])
    probs = probs if probs.dtype in (torch.float32, torch.float64) else probs.float()
    chunks = (probs if V % CHUNK == 0 else torch.nn.functional.pad(probs, (0, -V % CHUNK))).reshape(n, -1, CHUNK)
    outer = chunks.sum(-1).double().cumsum(-1)  # mass up to each chunk's end: sums of 256, then float64
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


# exp(-87): the smallest exp that is still a normal float32 (subnormals start below exp(-87.3)).
EXP_FLOOR = math.exp(-87.0)


def exp_normal(x: torch.Tensor) -> torch.Tensor:
    """exp of logits whose best is 0, without the mass of subnormal floats: exp(max(x, -87)) -
    exp(-87), so a token below -87 (or at -inf: a mask) gets exactly 0 and every other loses
    1.6e-38 (only those just above -87 can still come out subnormal). On x86 exp and sums take a
    slow path on subnormals, which a low temperature makes of most of a row's exponentials; this
    costs the same at any temperature.
    (measured: benchmarks/README.md, "Measurements behind the code's choices")"""
    if x.numel() == 0 or bool(x.amin() >= -87.0):  # (a trained model at temperature ~1: no tail that far)
        return x.exp()
    return x.clamp(min=-87.0).exp_().sub_(EXP_FLOOR)


# Candidate prefixes tried before sorting whole rows. A nucleus is usually a few dozen of SmolLM2's
# 49,152 tokens, and on the CPU the 128 largest (torch.topk) cost a small fraction of sorting the
# row. A row's prefix is enough when the token after it would be dropped anyway; the rows where it
# is not (flat ones) try the next, and last the full sort.
# (measured: benchmarks/README.md, "Measurements behind the code's choices")
CANDIDATES = (128, 2048)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows [B, V] of logits -> filtered, temperature-scaled logits (masked to -inf).

    temperature > 0 per row; top_k <= 0 or >= V means off; top_p = 1 and min_p = 0 mean off.
    The result is float32 and shifted so that each row's best token scores 0 (softmax is the same).
    """
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
    # top-p keeps token i while the mass strictly before it is still < top_p
    drop |= (mass - probs) >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    # token C, the first outside, would go: beyond top-k, past top-p's mass, or below min-p
    enough = (k <= C) | ((top_p < 1) & (mass[:, -1] >= top_p)) | (probs[:, -1] < min_p * probs[:, 0])
    return values.masked_fill(drop, float("-inf")), enough


def sampling_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Rows [n, V] of one request's logits -> the distributions its sampler draws from
    (one-hot on the argmax when greedy). Speculative decoding compares these on both sides."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).to(logits.dtype)
    p = exp_normal(_filter_rows(logits, [params] * logits.shape[0]))  # softmax, without subnormals
    return p / p.sum(-1, keepdim=True)


def _filter_rows(logits: torch.Tensor, params: list) -> torch.Tensor:
    """filter_logits with row i's knobs from params[i]."""
    return filter_logits(logits, *_knobs(params, logits))


def _knobs(params: list, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) per row. top_k is capped at the vocabulary here: any
    larger k means "off" too, and an int beyond 2**63 would not fit the tensor."""
    dev, V = logits.device, logits.shape[-1]
    return (torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([min(p.top_k, V) for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev), torch.tensor([p.min_p for p in params], device=dev))


def hold_back_stop_tokens(logits: torch.Tensor, rows: list[tuple[int, int, object, int]],
                          eos_token_ids: set[int]) -> torch.Tensor:
    """min_tokens, as vLLM applies it: until a request has generated min_tokens tokens, its stop
    tokens (EOS unless ignore_eos, and stop_token_ids) get probability zero, so something else
    is drawn. rows: (first logits row, rows, SamplingParams, tokens generated before the first
    of these rows), one per request; row j is the request's (generated + j)-th output.
    Returns logits to sample from: the input itself when nothing is held back, else a masked
    copy (log-probabilities are reported from the model's own logits, as vLLM does by default).
    """
    masked = logits
    for first, count, params, generated in rows:
        short = min(count, params.min_tokens - generated)  # rows still below min_tokens
        if short <= 0:  # the common case (min_tokens 0, or reached): nothing to build
            continue
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if not stop_ids:
            continue
        if masked is logits:
            masked = logits.clone()
        masked[first:first + short, sorted(stop_ids)] = float("-inf")
    return masked


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. `params` are SamplingParams; greedy rows take the argmax."""
    out = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:  # step choice: sampler tier (greedy only, or draws)
        return out
    sampled = logits if len(rows) == len(params) else logits[rows]
    values, order = filtered_candidates(sampled, *_knobs([params[i] for i in rows], logits))
    if order is not None and values.shape[-1] == logits.shape[-1]:  # a full sort: back to dense rows
        values, order = _dense(values, order, logits.shape[-1]), None
    elif order is not None:  # the candidates in vocabulary order: the draw a dense row would give
        order, by_id = order.sort(-1)
        values = values.gather(-1, by_id)
    picks = draw_tokens(exp_normal(values), [generators[i] for i in rows])  # best logit 0: unnormalized
    out[rows] = (picks if order is None else order.gather(-1, picks[:, None])[:, 0]).to(out.device)
    return out


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int):
    """Log-probabilities of the chosen tokens and the n most likely, from the raw logits."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, token_ids[:, None])[:, 0]
    top_v, top_i = logp.topk(n, dim=-1) if n > 0 else (None, None)
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    return chosen, ranks, top_v, top_i
