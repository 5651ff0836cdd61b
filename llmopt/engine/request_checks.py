"""What the engine accepts: every prompt and request is checked here before it is admitted.

A bad request is a ValueError naming the field and what is allowed, raised before any work:
text a tokenizer cannot take, token ids outside the vocabulary, a prompt that leaves no room
to generate, or a request whose worst case could never fit in the KV pool or a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from llmopt.model.dummy import refuse_text
from llmopt.sampling_params import SamplingParams


def check_text(name: str, text: str) -> None:
    """A ValueError naming `name` for text that is not Unicode a tokenizer can take: a lone
    surrogate (from a JSON escape such as "\\ud800") has no UTF-8 encoding."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid text: it holds a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


def check_prompt(engine, prompt, index: int | str = 0) -> tuple[str | None, list[int]]:
    """A prompt (text, or {'prompt_token_ids': [...]}) -> (text, token ids); ValueError if bad."""
    name = f"prompt {index}"
    if engine.config.load_format == "dummy" and (isinstance(prompt, str) or (
            isinstance(prompt, dict) and "prompt_token_ids" not in prompt)):
        raise refuse_text(f"{name}: a text prompt", str(engine.config.model))
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{name} is empty; give at least one character or token")
        check_text(name, prompt)
        text, ids = prompt, engine.tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{name}: prompt_token_ids must be a list of integers")
        ids = [int(t) for t in ids]
    elif isinstance(prompt, dict) and "prompt" in prompt:
        return check_prompt(engine, prompt["prompt"], index)
    else:
        raise ValueError(f"{name} must be a string or a dict with 'prompt' or "
                         f"'prompt_token_ids'; got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"{name} has no tokens; give at least one")
    vocab = engine.model_config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) >= engine.max_model_len:
        raise ValueError(f"{name} has {len(ids)} tokens; max_model_len is {engine.max_model_len}, "
                         f"so a prompt may have at most {engine.max_model_len - 1}")
    return text, ids


def check_request(engine, ids: list[int], params: SamplingParams, index: int | str = 0) -> None:
    """Reject a request the engine could never run: stop tokens outside the vocabulary, or a
    worst case that could never fit in the block pool (it would otherwise wait forever, or
    preempt everyone and still not fit)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {index}: sampling params must be a SamplingParams")
    if engine.config.load_format == "dummy" and params.stop_strings:
        raise refuse_text(f"request {index}: stop (strings to find in the text)", str(engine.config.model))
    vocab = engine.model_config.vocab_size
    outside = [t for t in params.stop_token_ids if t >= vocab]
    if outside:
        raise ValueError(f"request {index}: stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab})")
    held = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.eos_token_ids)
    if params.min_tokens and len(held) >= vocab:  # min_tokens masks them all: nothing to draw
        raise ValueError(f"request {index}: stop_token_ids and EOS cover the whole vocabulary, so "
                         "min_tokens leaves no token to generate")
    engine.structured.check(params, index)
    transfer = (params.extra_args or {}).get("kv_transfer_params")
    if transfer:  # disaggregated prefill / decode: what this engine is to send or receive, checked now
        if engine.kv_connector is None:
            raise ValueError(f"request {index}: kv_transfer_params, but this engine has no kv_transfer_config")
        engine.kv_connector.check(transfer, ids)
    worst = min(engine.max_model_len, len(ids) + (params.max_tokens or engine.max_model_len))
    need = engine.block_manager.blocks_needed(worst)
    if need > engine.num_blocks:
        raise ValueError(f"request {index} may need {worst} tokens = {need} KV blocks, but the pool "
                         f"has {engine.num_blocks}; lower max_tokens or raise num_kv_blocks")
    # Without chunked prefill a prompt (or a preempted request's recompute of prompt +
    # output) must fit in one step's token budget, or it would wait forever.
    if not engine.config.enable_chunked_prefill and worst > engine.config.max_num_batched_tokens:
        raise ValueError(f"request {index} may need {worst} tokens in one step, over "
                         f"max_num_batched_tokens={engine.config.max_num_batched_tokens} with chunked "
                         "prefill off; enable_chunked_prefill=True, or lower max_tokens")


def check_priority(priority) -> int:
    """A request's priority (lower runs first under scheduling_policy="priority"): an integer."""
    if not isinstance(priority, Integral) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    return int(priority)


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt and its sampling parameters, checked and tokenized (`LLMEngine.process_inputs`)."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
