"""The offline entry point: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Mirrors vLLM's `LLM` so what a learner writes here runs there with the import changed.
Everything a caller passes is checked before any work starts; a rejected call leaves
the engine as it was.
"""

from __future__ import annotations

import json
import time
from numbers import Integral
from pathlib import Path

import torch

from llmopt.config import EngineConfig
from llmopt.engine.generate import generate_with_cache
from llmopt.engine.sequence import Sequence
from llmopt.model.config import ModelConfig
from llmopt.model.loader import load_model
from llmopt.model.registry import resolve_model
from llmopt.outputs import RequestOutput
from llmopt.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "tiny", **kwargs):
        self.config = EngineConfig(model=model, **kwargs)  # TypeError on unknown arguments
        self.model_path = resolve_model(model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit}); allowed: 1..{limit}")
        self.max_model_len = self.config.max_model_len or limit
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype(self.model_config.torch_dtype)
        self.tokenizer = _load_tokenizer(self.config.tokenizer or self.model_path)
        self.eos_token_ids = set(self.model_config.eos_token_ids) | _generation_eos(self.model_path)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        torch.manual_seed(self.config.seed)
        self.model = load_model(self.model_path, self.dtype, self.device)
        self._generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self._next_request_id = 0
        self._stats = {"num_requests": 0, "prompt_tokens": 0, "generation_tokens": 0}

    def get_tokenizer(self):
        return self.tokenizer

    # -- generate ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        seqs = self._make_sequences(prompts, sampling_params, priority)
        if priority is not None:  # lower value first, as vLLM's priority policy
            order = sorted(range(len(seqs)), key=lambda i: (priority[i], i))
        else:
            order = list(range(len(seqs)))
        bar = _progress(len(seqs), use_tqdm)
        finish = (lambda s: bar.update(1)) if bar is not None else None
        step = self.config.max_num_seqs
        for start in range(0, len(order), step):
            batch = [seqs[i] for i in order[start:start + step]]
            generate_with_cache(self.model, batch, eos_token_ids=self.eos_token_ids,
                                max_model_len=self.max_model_len, tokenizer=self.tokenizer,
                                on_finish=finish)
        if bar is not None:
            bar.close()
        for s in seqs:
            s.finalize_text(self.tokenizer)
            self._stats["generation_tokens"] += len(s.output_token_ids)
        return [s.to_output() for s in seqs]

    def get_metrics(self) -> dict[str, float]:
        """Engine counters, named as vLLM's metrics (without the `vllm:` prefix)."""
        return {
            "kv_cache_usage_perc": 0.0,  # no request holds KV memory between calls
            "num_preemptions": 0.0,
            "prefix_cache_queries": 0.0,  # this engine has no prefix cache yet
            "prefix_cache_hits": 0.0,
            "spec_decode_num_drafts": 0.0,
            "spec_decode_num_draft_tokens": 0.0,
            "spec_decode_num_accepted_tokens": 0.0,
            **{k: float(v) for k, v in self._stats.items()},
        }

    # -- input checking ---------------------------------------------------------------------
    def _make_sequences(self, prompts, sampling_params, priority) -> list[Sequence]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a {'prompt_token_ids': [...]} dict, or a "
                             f"non-empty list of those; got {type(prompts).__name__}")
        n = len(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        elif isinstance(sampling_params, (list, tuple)) and len(sampling_params) == n and all(
                isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params must be a SamplingParams or a list of exactly one per "
                             f"prompt ({n})")
        if priority is not None:
            if not isinstance(priority, (list, tuple)) or len(priority) != n or not all(
                    isinstance(p, Integral) and not isinstance(p, bool) for p in priority):
                raise ValueError(f"priority must be a list of {n} integers (one per prompt)")
            if self.config.scheduling_policy != "priority":
                raise ValueError("priority was given but scheduling_policy is 'fcfs'; "
                                 "create the LLM with scheduling_policy='priority'")
        token_lists = [self._tokenize(i, p) for i, p in enumerate(prompts)]
        seqs = []
        now = time.perf_counter()
        for (text, ids), sp in zip(token_lists, params):
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            elif not sp.greedy:
                gen = self._generator
            seqs.append(Sequence(str(self._next_request_id), text, ids, sp, gen, arrival_time=now))
            self._next_request_id += 1
            self._stats["num_requests"] += 1
            self._stats["prompt_tokens"] += len(ids)
        return seqs

    def _tokenize(self, i: int, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; give at least one character or token")
            text, ids = prompt, self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"prompt {i}: prompt_token_ids must be a list of integers")
                ids = [int(t) for t in ids]
            else:
                return self._tokenize(i, prompt["prompt"])
        else:
            raise ValueError(f"prompt {i} must be a string or a dict with 'prompt' or "
                             f"'prompt_token_ids'; got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"prompt {i} has no tokens; give at least one")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             f"so a prompt may have at most {self.max_model_len - 1}")
        return text, ids


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ValueError(f"could not load a tokenizer from {path} ({type(e).__name__}: {e}); the "
                         "folder needs tokenizer.json and tokenizer_config.json") from None


def _generation_eos(path: Path) -> set[int]:
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return set()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
