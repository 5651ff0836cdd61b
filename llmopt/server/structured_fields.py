"""The request fields that constrain an output: OpenAI's `response_format`, vLLM's `structured_outputs`.

    "response_format": {"type": "json_object"}
    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": {...}, "strict": true}}
    "structured_outputs": {"json": {...}} | {"regex": "..."} | {"choice": [...]} | {"grammar": "..."}

`response_format` is OpenAI's, on /v1/chat/completions (the `openai` client's `response_format`
and `client.beta.chat.completions.parse(response_format=PydanticModel)` send it); vLLM's
`structured_outputs` works on both routes. Each becomes a `StructuredOutputsParams`; the grammar
is then compiled in a worker thread, so that a schema that does not compile is a 400 naming the
field and the compiler's message before the request is admitted, and the event loop and the
engine thread go on meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses

from llmopt.structured.params import KINDS, StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def structured_from_body(body: dict, chat: bool, error) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field it came from) from a request body; `error(message, param)` is
    the APIError to raise. At most one of the two fields."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise error("give 'response_format' or 'structured_outputs', not both", "response_format")
    if so is not None:
        return _structured_outputs(so, error), "structured_outputs"
    if rf is not None and chat:
        return _response_format(rf, error), "response_format"
    return None, None


def _response_format(rf, error) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMAT_TYPES:
        raise error(f"'response_format' must be an object whose 'type' is one of {list(RESPONSE_FORMAT_TYPES)}; "
                    f"got {rf!r}", "response_format")
    kind = rf["type"]
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in rf):
        raise error(f"'response_format' has an unexpected key {(extra or ['json_schema'])[0]!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
        raise error("'response_format.json_schema' must be an object with a 'name' (a non-empty string) "
                    "and a 'schema'", "response_format")
    unknown = sorted(set(js) - JSON_SCHEMA_KEYS)
    if unknown:
        raise error(f"'response_format.json_schema' has an unknown key {unknown[0]!r}; allowed: "
                    f"{sorted(JSON_SCHEMA_KEYS)}", "response_format")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise error("'response_format.json_schema.strict' must be true or false", "response_format")
    schema = js.get("schema", {})  # OpenAI's default: any JSON
    try:
        return StructuredOutputsParams(json=schema)
    except (ValueError, TypeError) as e:
        raise error(str(e).replace("structured_outputs.json", "'response_format.json_schema.schema'", 1),
                    "response_format") from None


def _structured_outputs(so, error) -> StructuredOutputsParams:
    allowed = set(KINDS) | {"disable_any_whitespace"}
    if not isinstance(so, dict):
        raise error(f"'structured_outputs' must be an object with one of {list(KINDS)}; got {so!r}",
                    "structured_outputs")
    unknown = sorted(set(so) - allowed)
    if unknown:
        raise error(f"'structured_outputs' has an unknown key {unknown[0]!r}; allowed: {sorted(allowed)}",
                    "structured_outputs")
    try:
        return StructuredOutputsParams(**so)
    except (ValueError, TypeError) as e:
        raise error(str(e), "structured_outputs") from None


def with_structured(params, so: StructuredOutputsParams | None):
    """The request's SamplingParams with its constraint (checked again by SamplingParams)."""
    return params if so is None else dataclasses.replace(params, structured_outputs=so)


async def compile_for_request(engine, params, field: str | None, error) -> None:
    """Compile the request's grammar in a worker thread (cached by the engine for when it is
    admitted); a spec that does not compile or breaks a limit is a 400 naming `field`."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(engine.structured.compile, params, field)
    except ValueError as e:
        raise error(str(e), field) from None
