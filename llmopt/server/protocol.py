"""OpenAI's request and response shapes, checked field by field before any engine work.

A request body becomes a `ParsedRequest` (the prompt, a `SamplingParams`, stream options)
or an `APIError` that names the offending field in OpenAI's error JSON:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

The fields are OpenAI's (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `stream`,
`stream_options`), plus the sampling extras vLLM's server takes (`top_k`, `min_p`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `priority`). An unknown field is an error, as
on OpenAI's API: a typo such as `max_token` must not be silently ignored. Every bound here
is one the engine can serve, so a request that parses never fails inside the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from numbers import Integral, Real

from llmopt.chat import MessageError, check_messages
from llmopt.engine.request_checks import check_text
from llmopt.sampling_params import MAX_TEMPERATURE, SamplingParams
from llmopt.server.structured_fields import structured_from_body, with_structured

MAX_STOP = 4          # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 64   # a stream holds back len(stop) - 1 characters until it knows they are no stop


class APIError(Exception):
    """An HTTP error answered in OpenAI's error JSON."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers  # e.g. Retry-After on a 503
        # a lone surrogate echoed from the request (say, an unknown field's name) has no UTF-8
        message, param = (_printable(v) for v in (message, param))
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


async def read_json_body(request, max_bytes: int):
    """The JSON body of a Starlette request, or an APIError: 415 not declared JSON, 413 over
    `max_bytes`, 400 not valid JSON. Used by the app and by a replica that is not ready yet."""
    # Only JSON: a web page may POST text/plain (or a form) to any address without asking the
    # browser's CORS preflight, but not application/json; parsing those anyway would let every
    # site the user visits drive a server on their machine.
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(f"the body must be JSON sent with 'Content-Type: application/json'; got "
                       f"{media_type or 'no Content-Type'!r}", status=415, code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    too_big = APIError(f"the request body is larger than {max_bytes:,} bytes", status=413,
                       code="request_too_large")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise too_big
    try:
        return json.loads(body)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise APIError(f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError("the request body nests too deeply to parse") from None


def _printable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class ParsedRequest:
    model: str
    prompt: str | list[int] | None        # completions: text or token ids
    messages: list[dict] | None           # chat: [{"role": ..., "content": str}, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    max_tokens_param: str = "max_tokens"  # chat may say max_completion_tokens
    structured_field: str | None = None   # response_format or structured_outputs, if constrained

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


# -- fields ----------------------------------------------------------------------------------------
SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
                   "user", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
                   # vLLM's extras
                   "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "priority",
                   "skip_special_tokens", "include_stop_str_in_output"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"model", "prompt", "echo", "suffix", "best_of", "structured_outputs",
                                       "kv_transfer_params"}   # vLLM's, for disaggregated prefill / decode
CHAT_FIELDS = SAMPLING_FIELDS | {"model", "messages", "max_completion_tokens", "top_logprobs",
                                 "response_format", "structured_outputs", "kv_transfer_params"}


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _get(body: dict, name: str, check, allowed: str, default=None):
    """body[name] if present and not null, else default; APIError naming the field if wrong."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise APIError(f"'{name}' must be {allowed}; got {value!r}", param=name)
    return value


def _check_text(name: str, text: str) -> None:
    """Text a tokenizer can take (no lone surrogates), or a 400 naming the field."""
    try:
        check_text(f"'{name}'", text)
    except ValueError as e:
        raise APIError(str(e), param=name) from None


def _not_supported(body: dict, name: str, neutral, what: str) -> None:
    """Fields clients send at their neutral value: accepted there, refused anywhere else
    (`false` is not 0, nor `0` false, though Python's == says so)."""
    value = body.get(name)
    if value is not None and not (value == neutral and isinstance(value, bool) == isinstance(neutral, bool)):
        raise APIError(f"'{name}' is not supported by this server ({what}); leave it out "
                       f"or set it to {neutral!r}", param=name)


def _check_fields(body, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object; got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(f"unrecognized request argument supplied: {unknown[0]!r}", param=unknown[0])


def _check_model(body: dict, served_model: str) -> str:
    model = body.get("model")
    if model is None:
        raise APIError(f"'model' is required; this server serves {served_model!r}", param="model")
    if not isinstance(model, str):
        raise APIError(f"'model' must be a string; got {model!r}", param="model")
    if model != served_model:
        raise APIError(f"the model {model!r} does not exist; this server serves {served_model!r}",
                       status=404, param="model", code="model_not_found")
    return model


def _sampling(body: dict, max_tokens_field: str = "max_tokens", default_max_tokens: int | None = 16):
    """The sampling fields common to both endpoints -> (SamplingParams, stream, include_usage, priority)."""
    for name, neutral, what in (("presence_penalty", 0, "no penalties"), ("frequency_penalty", 0, "no penalties"),
                                ("logit_bias", {}, "no logit bias")):
        _not_supported(body, name, neutral, what)
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise APIError(f"'n' must be 1 (one completion per request); got {n}", param="n")
    max_tokens = _get(body, max_tokens_field, _is_int, "an integer >= 1", default_max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"'{max_tokens_field}' must be >= 1; got {max_tokens}", param=max_tokens_field)
    temperature = _get(body, "temperature", _is_number, f"a number in [0, {MAX_TEMPERATURE:g}]", 1.0)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise APIError(f"'temperature' must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy); got {temperature}",
                       param="temperature")
    top_p = _get(body, "top_p", _is_number, "a number in (0, 1]", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(f"'top_p' must be in (0, 1]; got {top_p}", param="top_p")
    top_k = _get(body, "top_k", _is_int, "an integer (-1 or 0: off)", -1)
    if top_k < -1:
        raise APIError(f"'top_k' must be -1 or 0 (off) or a positive integer; got {top_k}", param="top_k")
    min_p = _get(body, "min_p", _is_number, "a number in [0, 1]", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise APIError(f"'min_p' must be in [0, 1]; got {min_p}", param="min_p")
    seed = _get(body, "seed", lambda v: _is_int(v) and 0 <= v < 2**63, "an integer in [0, 2**63)")
    stop = _get(body, "stop", lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) for s in v)), "a string or a list of strings")
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise APIError(f"'stop' must be up to {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} "
                       "characters", param="stop")
    for s in stops:
        _check_text("stop", s)
    stop_token_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(
        _is_int(t) and t >= 0 for t in v), "a list of non-negative integers")
    min_tokens = _get(body, "min_tokens", _is_int, "an integer >= 0", 0)
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise APIError(f"'min_tokens' must be in [0, {max_tokens_field}]; got {min_tokens}", param="min_tokens")
    flags = {name: _get(body, name, lambda v: isinstance(v, bool), "true or false", default)
             for name, default in (("ignore_eos", False), ("skip_special_tokens", True),
                                   ("include_stop_str_in_output", False), ("stream", False))}
    stream_options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = False
    if stream_options is not None:
        if not flags["stream"]:
            raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        unknown = sorted(set(stream_options) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise APIError(f"'stream_options' has an unknown key {unknown[0]!r}; allowed: include_usage",
                           param="stream_options")
        # continuous_usage_stats (vLLM's) is accepted and not acted on, but still a boolean:
        # "continuous_usage_stats": "x" passed unchecked. null is absent, as the schema says.
        for key in ("include_usage", "continuous_usage_stats"):
            if stream_options.get(key) is not None and not isinstance(stream_options[key], bool):
                raise APIError(f"'stream_options.{key}' must be true or false", param="stream_options")
        include_usage = stream_options.get("include_usage") or False
    priority = _get(body, "priority", _is_int, "an integer (lower is served first)", 0)
    _get(body, "user", lambda v: isinstance(v, str), "a string")
    transfer = _get(body, "kv_transfer_params", lambda v: isinstance(v, dict), "an object (disaggregated "
                    "prefill / decode: what the prefill server answered, or {\"do_remote_decode\": true})")
    try:  # checked above field by field; this only backs that up: a 400, never a 500
        params = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                                min_p=float(min_p), seed=seed, max_tokens=max_tokens, min_tokens=min_tokens,
                                stop=stop, stop_token_ids=stop_token_ids, ignore_eos=flags["ignore_eos"],
                                skip_special_tokens=flags["skip_special_tokens"],
                                include_stop_str_in_output=flags["include_stop_str_in_output"],
                                extra_args=None if transfer is None else {"kv_transfer_params": transfer})
    except (ValueError, TypeError) as e:
        raise APIError(str(e)) from None
    return params, flags["stream"], include_usage, priority


# -- the two endpoints --------------------------------------------------------------------------
def parse_completion(body, served_model: str) -> ParsedRequest:
    """POST /v1/completions: `prompt` is a string or a list of token ids (or a list of one of those)."""
    _check_fields(body, COMPLETION_FIELDS)
    model = _check_model(body, served_model)
    _not_supported(body, "echo", False, "the prompt is not repeated in the output")
    _not_supported(body, "suffix", "", "no insertion")
    _not_supported(body, "best_of", 1, "one completion per request")
    _not_supported(body, "logprobs", None, "log probabilities are not returned")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise APIError("'prompt' is required: a string or a list of token ids", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(f"'prompt' holds {len(prompt)} prompts; this server takes one per request "
                       "(send several requests: they are batched together)", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("'prompt' is empty; give at least one character", param="prompt")
        _check_text("prompt", prompt)
    elif not (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        raise APIError(f"'prompt' must be a non-empty string or a non-empty list of token ids; got "
                       f"{type(prompt).__name__}", param="prompt")
    params, stream, include_usage, priority = _sampling(body)
    params, field = _structured(body, params, chat=False)
    return ParsedRequest(model, prompt, None, params, stream, include_usage, priority, structured_field=field)


def parse_chat(body, served_model: str) -> ParsedRequest:
    """POST /v1/chat/completions: `messages` with roles and text content."""
    _check_fields(body, CHAT_FIELDS)
    model = _check_model(body, served_model)
    _not_supported(body, "logprobs", False, "log probabilities are not returned")
    _not_supported(body, "top_logprobs", 0, "log probabilities are not returned")
    messages = body.get("messages")
    if not isinstance(messages, list):  # a tuple never comes out of JSON; the checker takes both
        messages = None
    try:  # the same checks LLM.chat makes, with OpenAI's field names in the error
        plain = check_messages(messages, check_text=_check_text)
    except MessageError as e:
        raise APIError(str(e), param=e.field) from None
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise APIError("give 'max_completion_tokens' or 'max_tokens', not both", param="max_tokens")
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    # As in vLLM: without a limit a chat reply may run to the end of the context.
    params, stream, include_usage, priority = _sampling(body, field, default_max_tokens=None)
    params, constrained = _structured(body, params, chat=True)
    return ParsedRequest(model, None, plain, params, stream, include_usage, priority, field, constrained)


def _structured(body: dict, params: SamplingParams, chat: bool) -> tuple[SamplingParams, str | None]:
    """response_format / structured_outputs into the SamplingParams (see structured_fields.py)."""
    so, field = structured_from_body(body, chat, lambda message, param: APIError(message, param=param))
    try:
        return with_structured(params, so), field
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param=field) from None


# -- responses ---------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
                        kv_transfer_params: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, **({"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {})}


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, use: dict,
                  kv_transfer_params: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, **({"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {})}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, use: dict) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": use}
