"""Structured outputs: constrain a request's output to a JSON schema, regex, choice or grammar.

params.py (what a request asks for, checked) -> compiler.py (xgrammar, cached, off the step
loop) -> matcher.py (each request's grammar state and the batch bitmask) -> jump_forward.py
(forced text appended without a decode step) -> manager.py (the engine's hooks).
"""

from llmopt.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
