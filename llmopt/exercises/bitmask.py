"""Lesson 13's exercise: a grammar's packed bitmask applied to the logits, the step that makes
structured outputs a guarantee.

The bitmask is int32 [rows, ceil(V / 32)]: bit j of word w allows token 32 * w + j (xgrammar's
layout, and vLLM's and SGLang's). Token 31 of a word is its sign bit, so a word that allows it is
negative; bits past the vocabulary's end are padding. Row rows[i] of the logits keeps only what
bitmask[i] allows, every other logit becomes -inf, and the rest of the logits are left alone. The
check holds the learner's function against the engine's `apply_token_bitmask`
(llmopt/structured/bitmask.py); the live run has the model runner mask with it.
"""

from __future__ import annotations

import torch

from llmopt.exercises.base import Case, Exercise
from llmopt.structured.bitmask import apply_token_bitmask


def apply_token_bitmask_solution(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of logits [N, V] in which row rows[i] keeps only the tokens bitmask[i] allows
    (bitmask int32 [len(rows), ceil(V / 32)]); every other logit of those rows is -inf."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32)
    # shift the word down, then test bit 0: the sign bit (token 31 of a word) comes out as 1 too
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]   # [len(rows), V]
    masked = logits.clone()      # the engine reads the unmasked logits again (logprobs)
    masked[rows] = masked[rows].masked_fill(~allowed, float("-inf"))
    return masked


def pack(allowed: list[list[int]], vocab: int, padding: bool = False) -> torch.Tensor:
    """The int32 bitmask [len(allowed), ceil(vocab / 32)] allowing the given token ids in each row;
    `padding`: also set the bits past the vocabulary's end (which must be ignored)."""
    words = (vocab + 31) // 32
    bits = torch.zeros(len(allowed), words * 32, dtype=torch.int64)
    for r, ids in enumerate(allowed):
        bits[r, ids] = 1
    if padding:
        bits[:, vocab:] = 1
    packed = (bits.view(len(allowed), words, 32) << torch.arange(32)).sum(-1)    # each word as 0 .. 2^32 - 1
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)   # as int32 holds it


def _logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _inputs():
    g = torch.Generator().manual_seed(0)
    some = lambda vocab, n: sorted(torch.randperm(vocab, generator=g)[:n].tolist())   # noqa: E731
    low = [i for i in some(64, 20) if i % 32 != 31]
    yield "one row, a vocabulary of 64 (two words), no word's bit 31 set", _logits(0, 1, 64), [low], [0], 64, False
    yield ("bit 31 set: tokens 31 and 63 allowed, so both words are negative as int32",
           _logits(1, 1, 64), [[2, 31, 40, 63]], [0], 64, False)
    yield ("a vocabulary of 70, not a multiple of 32: the third word's bits past token 69 are padding",
           _logits(2, 1, 70), [some(70, 25)], [0], 70, True)
    yield "every token allowed (every word is -1)", _logits(3, 1, 70), [list(range(70))], [0], 70, True
    yield "exactly one token allowed (token 45)", _logits(4, 1, 70), [[45]], [0], 70, False
    yield ("five rows of logits, three constrained (rows 0, 2, 3 get bitmask rows 0, 1, 2); rows 1 and 4 "
           "are left as they are", _logits(5, 5, 100), [some(100, 30), some(100, 3), some(100, 60)], [0, 2, 3],
           100, False)


def cases():
    for note, logits, allowed, rows, vocab, padding in _inputs():
        bitmask = pack(allowed, vocab, padding)
        yield Case({"logits": logits, "bitmask": bitmask, "rows": rows}, apply_token_bitmask(logits, bitmask, rows),
                   lambda fn, x=logits, b=bitmask, r=rows: fn(x.clone(), b.clone(), list(r)), note=note)
    # last: the engine reads the logits again after masking (their logprobs), so they must not change
    logits, bitmask, rows = _logits(6, 3, 64), pack([[1, 5, 31], [0, 63]], 64), [1, 2]
    yield Case({"logits": logits, "bitmask": bitmask, "rows": rows},
               [apply_token_bitmask(logits, bitmask, rows), logits],
               lambda fn, x=logits, b=bitmask, r=rows: _returned_and_given(fn, x.clone(), b.clone(), list(r)),
               note="[what you return, the logits you were given afterwards]: those must be left as they were")


def _returned_and_given(fn, logits, bitmask, rows):
    return [fn(logits, bitmask, rows), logits]


# -- the live run ---------------------------------------------------------------------------------
def valid(llm, so, token_ids: list[int], text: str) -> bool:
    """Whether a whole output is one the constraint allows: a fresh matcher of its grammar accepts
    every token and ends with it (and a JSON answer parses)."""
    import json

    from llmopt.sampling_params import SamplingParams
    from llmopt.structured.matcher import RequestGrammar

    engine = llm.llm_engine
    grammar = RequestGrammar(engine.structured.compile(SamplingParams(structured_outputs=so)),
                             engine.eos_token_ids, engine.model_config.vocab_size)
    if not (all(grammar.accept(t) for t in token_ids) and grammar.is_terminated):
        return False
    if so.json is not None:
        try:
            json.loads(text)
        except ValueError:
            return False
    return True


def live(fn) -> str:
    """`tiny`, greedy, on lesson 13's three constraints (a JSON schema, a regex, a choice), its
    model runner masking the logits with fn, then with the engine's own apply_token_bitmask.
    Jump-forward is off, so that every output token is drawn under the mask."""
    from llmopt import LLM, SamplingParams
    from llmopt.viz.structured import EXAMPLES

    llm = LLM("tiny", device="cpu", dtype="float32", seed=0, num_kv_blocks=256)
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=so) for so in EXAMPLES.values()]
    prompts = ["x ="] * len(params)
    jump, engine.structured.enable_jump_forward = engine.structured.enable_jump_forward, False
    try:
        engine.runner.apply_token_bitmask = fn
        try:
            yours = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        except RuntimeError as e:   # a token the mask let through and the grammar refuses stops the request
            yours = e
        finally:
            del engine.runner.apply_token_bitmask   # back to the class's, the engine's own
        theirs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.structured.enable_jump_forward = jump
    lines = ["tiny, greedy, jump-forward off: every output token drawn from logits your function masked"]
    if isinstance(yours, RuntimeError):
        return "\n".join(lines + [f"DIFFERENT: the engine stopped, your mask let through a token the grammar "
                                   f"refuses ({yours})"])
    same = [list(y.token_ids) == list(t.token_ids) for y, t in zip(yours, theirs)]
    ok = [valid(llm, so, list(y.token_ids), y.text) for so, y in zip(EXAMPLES.values(), yours)]
    lines += [f"{'same' if s else 'DIFFERENT'}, {'valid' if v else 'NOT VALID'}: {name} -> {y.text!r}"
              for name, y, s, v in zip(EXAMPLES, yours, same, ok)]
    lines.append("the engine masking with your function writes its own outputs, each valid under its constraint"
                 if all(same) and all(ok) else "the engine masking with your function writes other outputs")
    return "\n".join(lines)


EXERCISE = Exercise("token_bitmask", 13, "apply a grammar's packed int32 bitmask to the logits (disallowed: -inf)",
                    cases, apply_token_bitmask_solution, live)
