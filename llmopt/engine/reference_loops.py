"""Two generation loops over the same model: without and with a KV cache.

`generate_naive` feeds every sequence's whole history through the model at every
step: token t costs O(t) model work (and O(t^2) attention), so n tokens cost O(n^2).
`generate_with_cache` runs the prompt once (prefill), keeps each layer's keys and
values, and then feeds only the newest token (decode): each step costs O(1) model work
plus attention over the cache. Both sample and stop identically, so with greedy
decoding they return the same tokens: the KV cache changes speed, never the result.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from llmopt.layers.attention import AttentionMetadata
from llmopt.layers.sampler import hold_back_stop_tokens, sample, top_logprobs
from llmopt.model.forward import run_model
from llmopt.sequence import Sequence, SequenceStatus
from llmopt.worker.kv_cache import ContiguousKVCache, NoKVCache


@torch.inference_mode()
def generate_naive(model, seqs: list[Sequence], *, eos_token_ids: set[int], max_model_len: int,
                   tokenizer=None, on_finish: Callable | None = None) -> list[Sequence]:
    """Recompute everything at every step. The baseline the KV cache improves on."""
    device = next(model.parameters()).device
    cache = NoKVCache()
    running = _start(seqs)
    while running:
        ids = torch.tensor([t for s in running for t in s.token_ids], device=device)
        hidden = run_model(model, cache, ids, AttentionMetadata.uncached([len(s) for s in running], device))
        last = torch.tensor([len(s) for s in running], device=device).cumsum(0) - 1
        logits = model.compute_logits(hidden[last])
        running = _sample_and_check(running, logits, eos_token_ids, max_model_len, tokenizer, on_finish)
    return seqs


@torch.inference_mode()
def generate_with_cache(model, seqs: list[Sequence], *, eos_token_ids: set[int], max_model_len: int,
                        tokenizer=None, on_finish: Callable | None = None,
                        make_cache: Callable[..., ContiguousKVCache] = ContiguousKVCache) -> list[Sequence]:
    """Prefill all prompts in one flat batch, then decode one token per sequence per step.
    make_cache: builds the cache (ContiguousKVCache's arguments); lesson 01's exercise passes
    one that stores through the learner's function."""
    cfg = model.config
    param = next(model.parameters())
    # Reserve each sequence's worst case up front: prompt + max_tokens (capped by the model).
    max_len = max(min(max_model_len, len(s) + (s.params.max_tokens or max_model_len)) for s in seqs)
    cache = make_cache(cfg.num_hidden_layers, len(seqs), max_len, cfg.num_key_value_heads,
                       cfg.head_dim, dtype=param.dtype, device=param.device)
    slot = {id(s): cache.allocate() for s in seqs}
    running = _start(seqs)
    # prefill: every prompt token of every sequence, flattened
    ids = torch.tensor([t for s in running for t in s.prompt_token_ids], device=param.device)
    meta = AttentionMetadata.contiguous([slot[id(s)] for s in running], [0] * len(running),
                                        [len(s) for s in running], param.device)
    hidden = run_model(model, cache, ids, meta)
    last = torch.tensor([len(s) for s in running], device=param.device).cumsum(0) - 1
    logits = model.compute_logits(hidden[last])
    running = _sample_and_check(running, logits, eos_token_ids, max_model_len, tokenizer, on_finish)
    # decode: only the newest token of each running sequence
    while running:
        ids = torch.tensor([s.output_token_ids[-1] for s in running], device=param.device)
        meta = AttentionMetadata.contiguous([slot[id(s)] for s in running], [len(s) - 1 for s in running],
                                            [1] * len(running), param.device)
        logits = model.compute_logits(run_model(model, cache, ids, meta))
        running = _sample_and_check(running, logits, eos_token_ids, max_model_len, tokenizer, on_finish)
    return seqs


def _start(seqs: list[Sequence]) -> list[Sequence]:
    now = time.perf_counter()
    for s in seqs:
        s.status = SequenceStatus.RUNNING
        s.metrics.first_scheduled_time = now
    return list(seqs)


def _sample_and_check(running, logits, eos_token_ids, max_model_len, tokenizer, on_finish):
    allowed = hold_back_stop_tokens(logits, [(i, 1, s.params, len(s.output_token_ids))
                                             for i, s in enumerate(running)], eos_token_ids)
    tokens = sample(allowed, [s.params for s in running], [s.generator for s in running])
    want = [s.params.logprobs for s in running]
    if any(n is not None for n in want):
        chosen, ranks, top_v, top_i = top_logprobs(logits, tokens, max(n or 0 for n in want))
    now = time.perf_counter()
    still = []
    for i, (s, t) in enumerate(zip(running, tokens.tolist())):
        s.append_token(t, now)
        if s.params.logprobs is not None:
            k = s.params.logprobs
            s.record_logprobs(t, float(chosen[i]), int(ranks[i]),
                              top_v[i, :k].tolist() if k else [], top_i[i, :k].tolist() if k else [])
        s.check_stop(eos_token_ids, max_model_len, tokenizer)
        if s.is_finished:
            if on_finish is not None:
                on_finish(s)
        else:
            still.append(s)
    return still
