"""A request in flight: its tokens, its sampling state, and when it must stop."""

from __future__ import annotations

import time
from enum import Enum

import torch

from llmopt.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmopt.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the queue, its KV freed, to be recomputed
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, generator: torch.Generator | None = None,
                 arrival_time: float | None = None, priority: int = 0):
        self.request_id = request_id
        self.priority = priority
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.is_finished = False  # status is FINISHED (set by `finish`, the one way there)
        self.finish_reason: str | None = None
        self.error: Exception | None = None  # what a step raised (finish_reason "error")
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] = []
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter())
        # paged engine state: how many of token_ids have their KV in the cache
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0   # prompt tokens found in the prefix cache
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # proposed continuation, verified in the next step
        self.spec_draft_probs: torch.Tensor | None = None  # [k, V] q of a model proposer
        self.spec_tree = None  # a DraftTree (llmopt/spec/draft_tree.py): spec_token_ids in its flat order
        self.grammar = None  # structured outputs: the matcher of its constraint (llmopt/structured)

    def clear_drafts(self) -> None:
        self.spec_token_ids, self.spec_draft_probs, self.spec_tree = [], None, None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    num_tokens = property(__len__)

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.token_times.append(now)

    def record_logprobs(self, token_id: int, logprob: float, rank: int, top_values: list[float],
                        top_ids: list[int]) -> None:
        self.cumulative_logprob += logprob
        entry = {token_id: Logprob(logprob, rank)}
        for r, (v, j) in enumerate(zip(top_values, top_ids)):
            if j in entry:
                entry[j].rank = r + 1
            else:
                entry[j] = Logprob(v, r + 1)
        self.logprobs.append(entry)

    def check_stop(self, eos_token_ids: set[int], max_model_len: int, tokenizer) -> None:
        """Decide after each new token whether the request is done, in vLLM's order."""
        p, last = self.params, self.output_token_ids[-1]
        n = len(self.output_token_ids)
        if p.stop_strings and tokenizer is not None:  # decoding every step only when needed
            self.output_text = self.decode(tokenizer)
        if n >= p.min_tokens:
            if not p.ignore_eos and last in eos_token_ids:
                return self.finish("stop", None)
            if last in p.stop_token_ids:
                return self.finish("stop", last)
            for s in p.stop_strings:
                # only the tail can hold a new match: look a little before the newest token
                at = self.output_text.find(s, max(0, len(self.output_text) - len(s) - 32))
                if at >= 0:
                    end = at + len(s) if p.include_stop_str_in_output else at
                    self.output_text = self.output_text[:end]
                    return self.finish("stop", s)
        if p.max_tokens is not None and n >= p.max_tokens:
            return self.finish("length", None)
        if len(self) >= max_model_len:
            return self.finish("length", None)

    def decode(self, tokenizer) -> str:
        return tokenizer.decode(self.output_token_ids, skip_special_tokens=self.params.skip_special_tokens)

    def finalize_text(self, tokenizer) -> None:
        """Detokenize once at the end, unless a stop string already cut the text."""
        if tokenizer is None:
            return
        if not isinstance(self.stop_reason, str):
            self.output_text = self.decode(tokenizer)
        for entry in self.logprobs:
            for tid, lp in entry.items():
                if lp.decoded_token is None:
                    lp.decoded_token = tokenizer.decode([tid])

    def finish(self, reason: str, stop_reason) -> None:
        self.status, self.is_finished = SequenceStatus.FINISHED, True
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.metrics.finished_time = time.perf_counter()

    def to_output(self) -> RequestOutput:
        out = CompletionOutput(
            index=0, text=self.output_text, token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=self.logprobs if self.params.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [out],
                             self.is_finished, self.metrics, self.num_cached_tokens, self.error,
                             getattr(self, "kv_transfer_params", None))
