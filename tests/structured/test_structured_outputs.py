"""Structured outputs in the engine, on the tiny model: every sampled output (temperature 1)
parses and validates; free requests batched with constrained ones are unchanged; the result is
the same with chunked prefill, prefix caching, preemption and FP8 KV; speculative decoding
with a grammar gives plain constrained greedy output (float32); jump-forward gives the same
greedy output as constrained decoding without it, in fewer steps."""

import json
import re

import jsonschema
import pytest

from llmopt import LLM, SamplingParams, StructuredOutputsParams
from llmopt.structured.jump_forward import jump_forward_tokens
from llmopt.structured.matcher import RequestGrammar

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"]}
PROMPTS = ["A person as JSON:", "def f(x):", "{\"a\": 1}"]
FREE = SamplingParams(temperature=0.0, max_tokens=24)


def json_params(seed=None, temperature=1.0, max_tokens=72, schema=PERSON):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=schema))


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_sampled_json_always_validates(tiny_llm):
    outs = tiny_llm.generate(["A person as JSON:"] * 48, [json_params(seed=i) for i in range(48)], use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


@pytest.mark.parametrize("so, check", [
    (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
    (StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
], ids=["regex", "choice", "grammar"])
def test_every_kind_of_constraint(tiny_llm, so, check):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=so) for i in range(16)]
    for o in tiny_llm.generate(["x ="] * 16, params, use_tqdm=False):
        assert o.outputs[0].finish_reason == "stop" and check(o.outputs[0].text), o.outputs[0].text


def test_json_object(tiny_llm):
    """Any object: its strings are unbounded, so at temperature 1 some run into max_tokens
    ("length"); every one that ends is an object."""
    so = StructuredOutputsParams(json_object=True)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=so) for i in range(16)]
    ended = [o.outputs[0].text for o in tiny_llm.generate(["x ="] * 16, params, use_tqdm=False)
             if o.outputs[0].finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(t), dict) for t in ended)


def test_free_requests_unchanged_beside_constrained_ones(tiny_llm):
    alone = texts(tiny_llm.generate(PROMPTS, FREE, use_tqdm=False))
    mixed = tiny_llm.generate(PROMPTS + ["A person as JSON:"] * 3,
                              [FREE] * 3 + [json_params(seed=i) for i in range(3)], use_tqdm=False)
    assert texts(mixed[:3]) == alone
    for o in mixed[3:]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_max_tokens_too_small_ends_with_length(tiny_llm):
    [o] = tiny_llm.generate(["A person as JSON:"], json_params(seed=0, max_tokens=5), use_tqdm=False)
    assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 5


@pytest.fixture(scope="module")
def greedy_reference(tiny_llm):
    """Constrained greedy outputs of a plain engine, without jump-forward."""
    engine = tiny_llm.llm_engine
    engine.structured.enable_jump_forward = False
    try:
        outs = tiny_llm.generate(PROMPTS, json_params(temperature=0.0), use_tqdm=False)
    finally:
        engine.structured.enable_jump_forward = True
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kwargs", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(enable_prefix_caching=True),
    dict(block_size=8, num_kv_blocks=10),  # too few blocks for all three: preemption and recompute
    dict(kv_cache_dtype="fp8"),
], ids=["chunked_prefill", "prefix_caching", "preemption", "fp8_kv"])
def test_engine_features_keep_the_constrained_output(greedy_reference, kwargs):
    llm = LLM(model="tiny", device="cpu", **kwargs)
    llm.llm_engine.structured.enable_jump_forward = False
    outs = llm.generate(PROMPTS, json_params(temperature=0.0), use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    if kwargs.get("kv_cache_dtype") != "fp8":  # FP8 KV changes the logits: valid, not identical
        assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == greedy_reference
    if "num_kv_blocks" in kwargs:
        assert llm.get_metrics()["num_preemptions"] > 0


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4},
], ids=["ngram", "draft_model"])
def test_speculative_decoding_with_a_grammar(greedy_reference, spec):
    llm = LLM(model="tiny", device="cpu", dtype="float32", speculative_config=spec)
    llm.llm_engine.structured.enable_jump_forward = False
    outs = llm.generate(PROMPTS, json_params(temperature=0.0), use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == greedy_reference
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    # drafts the grammar refuses are rejected: acceptance is below 100% on this schema
    assert m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]


def test_jump_forward_gives_the_same_output_in_fewer_steps(tiny_llm, greedy_reference):
    """Greedy with jump-forward equals greedy without it up to the first token where the two
    segment the same text differently (the jump uses the tokenizer's segmentation, the masked
    model may spell a key letter by letter): that first difference is always a forced token."""
    engine = tiny_llm.llm_engine
    before, steps = tiny_llm.get_metrics(), engine.step_count
    seqs = [engine.add_request(f"jf-{i}", p, json_params(temperature=0.0)) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished_requests():
        engine.step()
    jumped_steps = engine.step_count - steps
    assert tiny_llm.get_metrics()["structured_jump_forward_steps_saved"] > before["structured_jump_forward_steps_saved"]
    for seq, (ref_text, ref_ids) in zip(seqs, greedy_reference):
        ids, n = seq.output_token_ids, 0
        while n < min(len(ids), len(ref_ids)) and ids[n] == ref_ids[n]:
            n += 1
        assert (ids == ref_ids and seq.output_text == ref_text) or n in seq.grammar.forced_positions
        jsonschema.validate(json.loads(seq.output_text), PERSON)
    engine.structured.enable_jump_forward = False
    steps = engine.step_count
    tiny_llm.generate(PROMPTS, json_params(temperature=0.0), use_tqdm=False)
    engine.structured.enable_jump_forward = True
    assert jumped_steps < engine.step_count - steps


def test_jump_forward_equals_plain_where_segmentation_agrees(tiny_llm):
    """Forced text the masked model itself writes in the tokenizer's segmentation: the outputs
    are the same tokens, with or without jump-forward."""
    so = StructuredOutputsParams(regex=r"[0-9]{2}, [0-9]{2}, [0-9]{2}")
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=so)
    engine = tiny_llm.llm_engine
    with_jump = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    engine.structured.enable_jump_forward = False
    try:
        plain = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.structured.enable_jump_forward = True
    assert [o.outputs[0].token_ids for o in with_jump] == [o.outputs[0].token_ids for o in plain]


def test_jump_forward_tokens_are_the_tokenizers(tiny_llm):
    """The forced text is appended as the tokenizer segments it, the boundary with the sampled
    token included: where the tokenizer would merge them, the sampled token is re-encoded."""
    engine = tiny_llm.llm_engine
    tok = engine.tokenizer

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    grammar = RequestGrammar(engine.structured.compile(json_params()), engine.eos_token_ids,
                             engine.model_config.vocab_size)
    tokens, replaced = jump_forward_tokens(grammar, tok, None, False)
    assert tok.decode(tokens) == '{"name":' and tokens == encode('{"name":') and not replaced
    for t in encode('{"name": "ab", "age": 7') + encode(","):
        assert grammar.accept(t)
    comma = encode(",")[0]
    forced, replaced = jump_forward_tokens(grammar, tok, comma, True)
    text = tok.decode(forced)
    if replaced:  # the sampled comma was re-encoded together with the forced text
        assert text.startswith(",") and forced == encode(text)
    else:
        assert [comma] + forced == encode("," + text)
    assert "role" in text


def test_an_engine_without_structured_requests_never_imports_xgrammar():
    """xgrammar is imported by the first constrained request, not by every step: an engine serves
    plain requests where xgrammar is missing (a GPU image without it, a minimal install)."""
    import subprocess
    import sys

    code = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'xgrammar':
            raise ImportError('xgrammar is not installed here')
sys.meta_path.insert(0, Missing())
from llmopt import LLM, SamplingParams
out = LLM(model='tiny').generate(['def f(x):'], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4 and 'xgrammar' not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
