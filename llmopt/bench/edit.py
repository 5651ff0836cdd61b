"""The edit workload: a file of code and an instruction to rename one variable in it.

The answer repeats the prompt almost word for word, the case where speculation is cheapest to
feed: n-gram lookup (prompt lookup decoding) finds each next few tokens already in the prompt,
and every accepted token is a decode step saved. A request is a chat turn:

    Rename the variable `loop` to `new_loop` in the code below. Answer with the whole code and
    nothing else.

    ```python
    <~300 tokens of whole top-level blocks from the held-out Python>
    ```

Code comes from the evaluation split of the bundled held-out text (real Python files the
bundled models never saw), cut at top-level `def` / `class` blocks so that every snippet is
code as written. The variable renamed is the snippet's most frequent plain name (not a keyword,
a builtin or `self`), so the expected answer (`EditRequest.expected`) differs from the prompt's
code in a few places only (names as Python's tokenizer reads them: strings and comments keep
their words).
"""

from __future__ import annotations

import builtins
import io
import keyword
import random
import tokenize
from collections import Counter
from dataclasses import dataclass

from llmopt.bench.inputs import BenchRequest
from llmopt.chat import render_chat
from llmopt.model.registry import heldout_text

NOT_VARIABLES = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}
INSTRUCTION = ("Rename the variable `{old}` to `{new}` in the code below. Answer with the whole code and "
               "nothing else.\n\n```python\n{code}\n```")


@dataclass
class EditRequest(BenchRequest):
    """A BenchRequest whose answer is known: `expected` is the code with the variable renamed."""

    code: str = ""
    old: str = ""
    new: str = ""
    expected: str = ""


def top_level_blocks(text: str) -> list[str]:
    """The text's top-level `def` and `class` blocks, each up to the next line at column 0."""
    blocks, current = [], None
    for line in text.splitlines():
        starts = line.startswith(("def ", "class ", "async def "))
        if line and not line[0].isspace() and current is not None and not line.startswith((")", "]", "}")):
            blocks.append("\n".join(current).rstrip())
            current = None
        if starts:
            current = [line]
        elif current is not None:
            current.append(line)
    if current is not None:
        blocks.append("\n".join(current).rstrip())
    return blocks


def plain_names(code: str) -> list[tuple[int, int, str]]:
    """(line, column, name) of every name the code uses as a name: not in a string or a comment,
    not an attribute (`x.name`), not a keyword. Read with Python's own tokenizer."""
    out, previous = [], None
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string) and previous != ".":
            out.append((*tok.start, tok.string))
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            previous = tok.string
    return out


def rename_target(code: str) -> str | None:
    """The code's most frequent variable-like name used at least 3 times (not a builtin, `self`,
    a constant or shorter than 3 letters; ties: the first seen), or None."""
    counts = Counter(name for _, _, name in plain_names(code)
                     if name not in NOT_VARIABLES and len(name) >= 3 and not name.isupper())
    best = [name for name, n in counts.most_common() if n >= 3]
    return best[0] if best else None


def rename(code: str, old: str, new: str) -> str:
    """Every use of the name `old` as a name (not in strings or comments, not `x.old`) as `new`."""
    lines = code.split("\n")
    for row, col, name in reversed(plain_names(code)):  # from the end: earlier columns stay put
        if name == old:
            line = lines[row - 1]
            lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "\n".join(lines)


def edit_requests(tokenizer, num_requests: int = 8, code_tokens: int = 300, seed: int = 0,
                  extra_tokens: int = 32) -> list[EditRequest]:
    """`num_requests` rename requests over snippets of about `code_tokens` tokens of code (whole
    top-level blocks, between 0.8x and 1.3x that many), disjoint, chosen at random with `seed`;
    each asks for as many tokens as its expected answer plus `extra_tokens`. The prompt is the
    tokenizer's chat template around the instruction (a plain tokenization where it has none)."""
    if num_requests < 1 or code_tokens < 16:
        raise ValueError(f"need num_requests >= 1 and code_tokens >= 16, got {num_requests}, {code_tokens}")

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    blocks = top_level_blocks(heldout_text("eval"))
    starts = list(range(len(blocks)))
    random.Random(seed).shuffle(starts)
    used: set[int] = set()
    out: list[EditRequest] = []
    for start in starts:
        if len(out) == num_requests:
            break
        snippet, n, end = [], 0, start
        while end < len(blocks) and end not in used and n < 0.8 * code_tokens:
            snippet.append(blocks[end])
            n = count("\n\n\n".join(snippet))
            end += 1
        if not 0.8 * code_tokens <= n <= 1.3 * code_tokens:
            continue
        code = "\n\n\n".join(snippet)
        old = rename_target(code)
        if old is None:
            continue
        new = f"new_{old}"
        text = INSTRUCTION.format(old=old, new=new, code=code)
        if getattr(tokenizer, "chat_template", None):
            _, ids = render_chat(tokenizer, [{"role": "user", "content": text}])
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected = rename(code, old, new)
        used.update(range(start, end))
        out.append(EditRequest(ids, count(expected) + extra_tokens, code, old, new, expected))
    if len(out) < num_requests:
        raise ValueError(f"the held-out text gives {len(out)} snippets of about {code_tokens} tokens with a name "
                         f"to rename, not {num_requests}")
    return out
