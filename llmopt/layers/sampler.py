"""Turn logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Order, as in vLLM: divide by temperature; keep the k most likely tokens; keep the
smallest set whose probability reaches top_p; drop tokens below min_p x the top
probability; renormalize and draw. Each request may bring its own seeded generator,
so its samples do not depend on what else is in the batch.

No accepted parameter can make a draw fail: the division happens in float32 after each row's
maximum is subtracted, so the best token scores 0 and every other one is <= 0 (-inf at worst,
probability 0), never the inf - inf = NaN that a tiny temperature gives a raw division.

This file is the plain sampler, in torch, top to bottom: what `enforce_eager=True` runs and
the reference of llmopt/layers/sampler_cpu.py, which gives the same answers faster on a CPU's
shapes (the tests hold the two equal). Both offer the same functions; an engine picks one
when it is built (`choose_step_backend`).
"""

from __future__ import annotations

import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit ([..., V] -> [...], int64): the first index on
    ties, NaN counting as the largest."""
    return logits.argmax(-1)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows [B, V] of logits -> filtered, temperature-scaled logits (masked to -inf).

    temperature > 0 per row; top_k <= 0 or >= V means off; top_p = 1 and min_p = 0 mean off.
    The result is float32 and shifted so that each row's best token scores 0 (softmax is the same).
    """
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)).div_(temperature.float()[:, None])
    V = logits.shape[-1]
    values, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k <= 0, V, top_k.clamp(max=V))
    drop = torch.arange(V, device=logits.device)[None, :] >= k[:, None]   # top-k
    probs = values.masked_fill(drop, float("-inf")).softmax(-1)
    mass = probs.cumsum(-1)
    drop |= ((mass - probs) >= top_p[:, None]) & (top_p[:, None] < 1)  # top-p (1: off, whatever the rounding)
    drop |= probs < min_p[:, None] * probs[:, :1]      # min-p: against the most likely token
    drop[:, 0] = False                                 # the most likely token always survives
    return logits.scatter(-1, order, values.masked_fill(drop, float("-inf")))


def draw_tokens(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One token per row of `probs` [n, V] (unnormalized is fine), row i drawn with generators[i]
    (None: torch's global generator): one uniform u per row, and the first token whose cumulative
    probability passes u x the row's total (inverse-CDF sampling). A token of probability 0 is never
    drawn, and each row takes exactly one number from its own generator, so a seeded request draws
    the same tokens wherever it sits in the batch."""
    return draw_from_uniforms(probs, uniforms(generators, probs.device))


def uniforms(generators: list, device) -> torch.Tensor:
    """One float64 uniform per generator (None: torch's global one), on `device`."""
    return torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=device) for g in generators])


def draw_token(probs: torch.Tensor, generator=None) -> int:
    """`draw_tokens` for one distribution [V]."""
    return int(draw_tokens(probs[None], [generator])[0])


def draw_from_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`draw_tokens` with each row's uniform u [n] (float64) already drawn: the form a recorded
    step takes (llmopt/worker/cuda_graphs.py), whose draws are made before it replays."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def knobs(params: list, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) per row from params[i]. top_k is capped at the
    vocabulary here: any larger k means "off" too, and an int beyond 2**63 would not fit."""
    dev, V = logits.device, logits.shape[-1]
    return (torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([min(p.top_k, V) for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev), torch.tensor([p.min_p for p in params], device=dev))


def sampling_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Rows [n, V] of one request's logits -> the distributions its sampler draws from
    (one-hot on the argmax when greedy). Speculative decoding compares these on both sides."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).to(logits.dtype)
    return filter_logits(logits, *knobs([params] * logits.shape[0], logits)).softmax(-1)


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. `params` are SamplingParams; greedy rows take the argmax."""
    out = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:  # step choice: sampler tier (greedy only, or draws)
        filtered = filter_logits(logits[rows], *knobs([params[i] for i in rows], logits))
        out[rows] = draw_tokens(filtered.exp(), [generators[i] for i in rows]).to(out.device)  # best logit 0
    return out


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


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int):
    """Log-probabilities of the chosen tokens and the n most likely, from the raw logits."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, token_ids[:, None])[:, 0]
    top_v, top_i = logp.topk(n, dim=-1) if n > 0 else (None, None)
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    return chosen, ranks, top_v, top_i
