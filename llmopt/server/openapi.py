"""The request bodies protocol.py accepts, written out as JSON Schema for `/openapi.json`.

The parser in protocol.py is the authority; this is its description, with this server's
limits (its model name, context, vocabulary), served with the API so that clients, `/docs`
and fuzzers know what a request may hold. A test holds the two together: schemathesis sends
bodies that break this schema and each must be refused with a 4xx, and bodies that fit it
must never get a 5xx. Every optional field may also be null, which means "not given", as the
parser reads it.
"""

from __future__ import annotations

from llmopt.sampling_params import MAX_TEMPERATURE
from llmopt.chat import CHAT_ROLES
from llmopt.server.protocol import MAX_STOP, MAX_STOP_CHARS


def _optional(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _only(*values) -> dict:
    """A field clients send at a neutral value; any other is refused."""
    return {"enum": [*values, None]}


STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": list(CHAT_ROLES)},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}}}


def request_schemas(model: str, max_model_len: int, vocab_size: int, priority_scheduling: bool,
                    kv_transfer: bool = False) -> dict[str, dict]:
    """path -> JSON Schema of the body, for POST /v1/completions and /v1/chat/completions
    (`kv_transfer`: the server has a kv_transfer_config, so kv_transfer_params may say something)."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    # a prompt has at least one token, and prompt + max_tokens must fit the context
    max_tokens = _optional({"type": "integer", "minimum": 1, "maximum": max_model_len - 1})
    sampling = {
        "temperature": _optional({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
        "top_p": _optional({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _optional({"type": "integer", "minimum": -1}),
        "min_p": _optional({"type": "number", "minimum": 0, "maximum": 1}),
        "seed": _optional({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
        "max_tokens": max_tokens,
        "min_tokens": _optional({"type": "integer", "minimum": 0}),
        "stop": _optional({"anyOf": [STOP, {"type": "array", "items": STOP, "maxItems": MAX_STOP}]}),
        "stop_token_ids": _optional({"type": "array", "items": token_id}),
        "n": _only(1),
        "stream": _optional({"type": "boolean"}),
        "stream_options": _optional({"type": "object", "additionalProperties": False, "properties": {
            "include_usage": _optional({"type": "boolean"}),
            "continuous_usage_stats": _optional({"type": "boolean"})}}),
        "ignore_eos": _optional({"type": "boolean"}),
        "skip_special_tokens": _optional({"type": "boolean"}),
        "include_stop_str_in_output": _optional({"type": "boolean"}),
        "priority": _optional({"type": "integer"}) if priority_scheduling else _only(0),
        "user": _optional({"type": "string"}),
        "presence_penalty": _only(0),
        "frequency_penalty": _only(0),
        "logit_bias": _optional({"type": "object", "maxProperties": 0}),
        "kv_transfer_params": _optional({"type": "object"} if kv_transfer else {"type": "object", "maxProperties": 0}),
    }
    common = {"type": "object", "additionalProperties": False,
              # stream_options only with "stream": true
              "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
              "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
    completion = {**common, "required": ["model", "prompt"], "properties": {
        "model": {"const": model},  # any other name is a 404
        "prompt": {"anyOf": [  # text or token ids, or a batch of exactly one of those
            {"type": "string", "minLength": 1}, token_ids,
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 1}]},
        "echo": _only(False), "suffix": _only(""), "best_of": _only(1), "logprobs": {"type": "null"},
        **sampling}}
    chat = {**common, "required": ["model", "messages"],
            "not": {"required": ["max_tokens", "max_completion_tokens"]},  # one or the other
            "properties": {
                "model": {"const": model},
                "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
                "max_completion_tokens": max_tokens,
                "logprobs": _only(False), "top_logprobs": _only(0),
                **sampling}}
    return {"/v1/completions": completion, "/v1/chat/completions": chat}


def request_body(schema: dict) -> dict:
    """FastAPI's `openapi_extra` for a route that reads this JSON body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
