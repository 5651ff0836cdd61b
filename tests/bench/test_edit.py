"""The edit workload (llmopt.bench.edit): rename requests over real code whose answers repeat
the prompt, so that n-gram lookup in the prompt predicts most of each answer."""

import pytest

from llmopt import model_path
from llmopt.bench.edit import edit_requests, plain_names, rename, rename_target, top_level_blocks


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path("tiny")))


def lookup_share(prompt: list[int], answer: list[int], n: int = 3) -> float:
    """Share of the answer's tokens (after its first n) that follow their n preceding tokens
    somewhere in the prompt: what prompt lookup would propose correctly."""
    follows: dict[tuple, set] = {}
    for i in range(len(prompt) - n):
        follows.setdefault(tuple(prompt[i:i + n]), set()).add(prompt[i + n])
    hits = [answer[i] in follows.get(tuple(answer[i - n:i]), ()) for i in range(n, len(answer))]
    return sum(hits) / len(hits)


def test_eight_rename_requests_over_real_code(tokenizer):
    reqs = edit_requests(tokenizer, 8, 300, seed=0)
    assert len(reqs) == 8 and len({r.code for r in reqs}) == 8
    for r in reqs:
        n = len(tokenizer(r.code, add_special_tokens=False)["input_ids"])
        assert 240 <= n <= 390, n
        assert r.code.lstrip().startswith(("def ", "class ", "async def "))
        compile(r.code, "<snippet>", "exec")  # whole blocks: code as written
        uses = sum(name == r.old for _, _, name in plain_names(r.code))
        assert uses >= 3 and sum(name == r.new for _, _, name in plain_names(r.expected)) == uses
        assert r.old not in {name for _, _, name in plain_names(r.expected)}
        assert r.new == f"new_{r.old}" and r.expected == rename(r.code, r.old, r.new) != r.code
        text = tokenizer.decode(r.prompt_token_ids)
        assert r.code in text and f"`{r.old}` to `{r.new}`" in text
        answer = tokenizer(r.expected, add_special_tokens=False)["input_ids"]
        assert r.max_tokens == len(answer) + 32
        assert lookup_share(r.prompt_token_ids, answer) >= 0.8  # the answer is mostly in the prompt


def test_the_workload_is_fixed_by_its_seed(tokenizer):
    a, b = edit_requests(tokenizer, 3, 200, seed=1), edit_requests(tokenizer, 3, 200, seed=1)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.code for r in edit_requests(tokenizer, 3, 200, seed=2)] != [r.code for r in a]


def test_blocks_names_and_renames():
    text = "import os\n\ndef f(x):\n    y = x\n    return y\n\nX = 1\n\nclass A:\n    def g(self):\n        pass\n"
    assert top_level_blocks(text) == ["def f(x):\n    y = x\n    return y", "class A:\n    def g(self):\n        pass"]
    code = "def f(loop):\n    loop.run(loop)  # the loop\n    self.loop = loop\n    return looped(loop, 'loop')\n"
    assert rename_target(code) == "loop"
    assert rename(code, "loop", "new_loop") == ("def f(new_loop):\n    new_loop.run(new_loop)  # the loop\n"
                                                "    self.loop = new_loop\n    return looped(new_loop, 'loop')\n")
    assert rename_target("def f(self):\n    return self, self, len(len(len([])))\n") is None


def test_bad_arguments_are_named(tokenizer):
    with pytest.raises(ValueError, match="num_requests >= 1"):
        edit_requests(tokenizer, 0)
    with pytest.raises(ValueError, match="not 100000"):
        edit_requests(tokenizer, 100_000, 300)
