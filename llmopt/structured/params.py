"""What a request may constrain its output to: vLLM's `StructuredOutputsParams` (vLLM >= 0.12).

Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (a list of
strings), `grammar` (EBNF, GBNF style) or `json_object=True` (any JSON object). Everything is
checked here, cheaply and before any compile: the types, and the size limits that keep a hostile
spec (deep nesting, a huge enum, a regex whose repetitions multiply) from costing the compiler
unbounded time or memory. What the compiler itself rejects is reported later, still before the
request runs (llmopt/structured/compiler.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# Limits, each far above a real schema and far below what makes a compile take seconds. A
# schema of depth 200 (measured) compiles in ~1 s; depth 32 covers every real API payload.
MAX_SPEC_CHARS = 65_536   # the text of a schema, regex or grammar
MAX_DEPTH = 32            # nesting of objects/arrays in a JSON schema (and of a regex's groups)
MAX_CHOICES = 1_024       # strings in `choice`, values in one schema `enum`
MAX_ENUM_TOTAL = 4_096    # enum/const values in a whole schema
MAX_REPEAT = 1_000        # the product of nested {n,m} bounds in a regex
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, vLLM's field names.

    `disable_any_whitespace` (vLLM's option) is True by default here, unlike vLLM: JSON then has
    json.dumps' separators (`, ` and `: `) and no free whitespace. With free whitespace a small
    model at temperature 1 fills its budget with newlines (3 of 4 tiny-model outputs ran into
    max_tokens=60), and nothing between two keys is forced, so jump-forward has nothing to skip.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    _key: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or "
                             f"json_object=True; got {given or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError(f"structured_outputs.disable_any_whitespace must be True or False, "
                            f"got {self.disable_any_whitespace!r}")
        kind = given[0]
        object.__setattr__(self, "_key", (kind, _check(kind, getattr(self, kind)), self.disable_any_whitespace))

    @property
    def kind(self) -> str:
        return self._key[0]

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's canonical JSON, the regex, or the grammar."""
        return self._key[1]

    @property
    def key(self) -> tuple:
        """What the compiled grammar is cached under: two requests with the same key share it."""
        return self._key


def _check(kind: str, value) -> str:
    """The spec as canonical text, or a ValueError/TypeError naming the field."""
    name = f"structured_outputs.{kind}"
    if kind == "json_object":
        if value is not True:
            raise TypeError(f"{name} must be True (any JSON object), got {value!r}")
        return ""
    if kind == "json":
        if isinstance(value, str):
            _size(name, value)
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{name} is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise TypeError(f"{name} must be a JSON schema (an object, or its text), got {type(value).__name__}")
        check_schema_size(name, value)
        # the keys keep their order: the grammar writes properties in the order they are declared.
        # Not JSON (a set, a tuple key; NaN, which json.dumps writes but no JSON parser takes):
        # an error naming the field, not json's own words or the compiler's parse error
        try:
            text = json.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name} is not a JSON schema: {e}") from None
        _size(name, text)
        return text
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise TypeError(f"{name} must be a non-empty list of non-empty strings, got {value!r}")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"{name} has {len(value):,} strings; at most {MAX_CHOICES:,} are allowed")
        text = json.dumps(list(value))
        _size(name, text)
        return text
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string, got {value!r}")
    _size(name, value)
    if kind == "regex":
        check_regex_size(name, value)
    return value


def _size(name: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{name} is {len(text):,} characters; at most {MAX_SPEC_CHARS:,} are allowed")


def check_schema_size(name: str, schema) -> None:
    """Refuse a schema nested deeper than MAX_DEPTH or with more enum values than allowed.
    Walks iteratively: a hostile schema must not hit Python's recursion limit here either."""
    total, stack = 0, [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{name} nests deeper than {MAX_DEPTH} levels; flatten the schema")
        if isinstance(node, dict):
            values = node.get("enum")
            if isinstance(values, list):
                if len(values) > MAX_CHOICES:
                    raise ValueError(f"{name} has an enum of {len(values):,} values; at most "
                                     f"{MAX_CHOICES:,} are allowed")
                total += len(values)
            total += "const" in node
            stack += [(v, depth + 1) for v in node.values() if isinstance(v, (dict, list))]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node if isinstance(v, (dict, list))]
        if total > MAX_ENUM_TOTAL:
            raise ValueError(f"{name} has over {MAX_ENUM_TOTAL:,} enum/const values in all; fewer are allowed")


def check_regex_size(name: str, regex: str) -> None:
    """Refuse a regex whose nested counted repetitions multiply past MAX_REPEAT (`(a{100}){100}`
    is 10,000 copies of `a` once expanded into automaton states), or whose groups nest deeper
    than MAX_DEPTH. `*` and `+` are loops, not copies: they cost nothing here."""
    inner = [1]  # per open group: the largest repetition product inside it so far
    last, i = 1, 0  # the product of the atom just read (a group's is its inner product)
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            last, i = 1, i + 2
            continue
        if c == "[":  # a class is one atom: skip to its end (braces inside are literal)
            j = i + 1 + (regex[i + 1:i + 2] == "]")
            while j < len(regex) and regex[j] != "]":
                j += 1 + (regex[j] == "\\")
            last, i = 1, j + 1
            continue
        if c == "(":
            inner.append(1)
            if len(inner) > MAX_DEPTH:
                raise ValueError(f"{name} nests groups deeper than {MAX_DEPTH} levels")
        elif c == ")" and len(inner) > 1:
            last = inner.pop()
            inner[-1] = max(inner[-1], last)
        elif c == "{" and (j := regex.find("}", i)) > 0 and _is_count(regex[i + 1:j]):
            last *= max(int(b) for b in regex[i + 1:j].split(",") if b.strip())
            if last > MAX_REPEAT:
                raise ValueError(f"{name} repeats a pattern {last:,} times once its counted repetitions "
                                 f"multiply out; at most {MAX_REPEAT:,} are allowed")
            inner[-1] = max(inner[-1], last)
            i = j
        else:
            last = 1
        i += 1


def _is_count(text: str) -> bool:
    """The inside of `{n}`, `{n,}` or `{n,m}`."""
    parts = [b.strip() for b in text.split(",")]
    # ASCII digits only: str.isdigit() takes "²", which int() then refused with a bare
    # "invalid literal for int()"; a regex counts in ASCII digits only
    return 1 <= len(parts) <= 2 and _digits(parts[0]) and all(_digits(b) or not b for b in parts)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()
