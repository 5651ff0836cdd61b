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

import numpy as np
import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit ([..., V] -> [...], int64): torch.argmax's answer,
    the first index on ties, NaN counting as the largest, as numpy's argmax gives it.

    Why not torch.argmax: on the CPU it is a scalar loop, 85-120 us for one row of SmolLM2's
    49,152 logits against numpy's vectorized 4 us; 64 rows took 3.5 ms, 5% of a 64-sequence
    Q8_0 decode step, and a speculative step's verification asks for it once per position."""
    if logits.device.type != "cpu" or logits.requires_grad or not logits.is_floating_point():
        return logits.argmax(-1)
    rows = logits.detach()
    if rows.dtype not in (torch.float32, torch.float64):
        rows = rows.float()  # bfloat16 / float16 widen exactly: the same order, the same ties
    return torch.from_numpy(np.asarray(rows.numpy().argmax(-1)))


def draw_tokens(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One token per row of `probs` [n, V] (unnormalized is fine), row i drawn with generators[i]
    (None: torch's global generator): one uniform u per row, and the first token whose cumulative
    probability passes u x the row's total (inverse-CDF sampling). A token of probability 0 is never
    drawn, and each row takes exactly one number from its own generator, so a seeded request draws
    the same tokens wherever it sits in the batch.

    Why not torch.multinomial: on the CPU it takes 1.2 ms for one row of SmolLM2's 49,152
    probabilities, a fifth of a Q8_0 decode step at batch 1, and about 80 ms for 64 rows, more than
    the step's forward; a float64 cumulative sum over all rows takes about 0.02 ms a row."""
    dev = probs.device
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=dev) for g in generators])
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1)  # (u < 1 keeps it below V; rounding cannot push it out)


def draw_token(probs: torch.Tensor, generator=None) -> int:
    """`draw_tokens` for one distribution [V]."""
    return int(draw_tokens(probs[None], [generator])[0])


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows [B, V] of logits -> filtered, temperature-scaled logits (masked to -inf).

    temperature > 0 per row; top_k <= 0 or >= V means off; top_p = 1 and min_p = 0 mean off.
    The result is float32 and shifted so that each row's best token scores 0 (softmax is the same).
    """
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)).div_(temperature.float()[:, None])  # (amax: 10x max's speed)
    V = logits.shape[-1]
    k = torch.where(top_k <= 0, V, top_k.clamp(max=V))
    if bool((k < V).any() or (top_p < 1).any() or (min_p > 0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=logits.device)[None, :]
        drop = ranks >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(-1)
        # top-p keeps token i while the mass strictly before it is still < top_p
        drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop |= probs < min_p[:, None] * probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sampling_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Rows [n, V] of one request's logits -> the distributions its sampler draws from
    (one-hot on the argmax when greedy). Speculative decoding compares these on both sides."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).to(logits.dtype)
    return _filter_rows(logits, [params] * logits.shape[0]).softmax(-1)


def _filter_rows(logits: torch.Tensor, params: list) -> torch.Tensor:
    """filter_logits with row i's knobs from params[i]. top_k is capped at the vocabulary here:
    any larger k means "off" too, and an int beyond 2**63 would not fit the tensor."""
    dev, V = logits.device, logits.shape[-1]
    return filter_logits(logits, torch.tensor([p.temperature for p in params], device=dev),
                         torch.tensor([min(p.top_k, V) for p in params], device=dev),
                         torch.tensor([p.top_p for p in params], device=dev),
                         torch.tensor([p.min_p for p in params], device=dev))


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


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [B, ceil(V / 32)] -> bool [B, V]: bit j of word w allows token 32 * w + j
    (xgrammar's layout, and vLLM's and SGLang's)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Structured outputs: a copy of `logits` in which row rows[i] keeps only the tokens that
    bitmask[i] allows (the rest -inf). It comes before temperature, top-k and top-p, so a draw
    is from the model's distribution renormalized over the allowed tokens, then filtered."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    index = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[index] = masked[index].masked_fill(~allowed, float("-inf"))
    return masked


def sample(logits: torch.Tensor, params: list, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. `params` are SamplingParams; greedy rows take the argmax."""
    out = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    probs = _filter_rows(logits[rows], [params[i] for i in rows]).softmax(-1)
    out[rows] = draw_tokens(probs, [generators[i] for i in rows]).to(out.device)
    return out


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int):
    """Log-probabilities of the chosen tokens and the n most likely, from the raw logits."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, token_ids[:, None])[:, 0]
    top_v, top_i = logp.topk(n, dim=-1) if n > 0 else (None, None)
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    return chosen, ranks, top_v, top_i
