"""Lesson 13's views: the allowed-token set step by step under a grammar, and its forced runs.

`mask_steps` walks a constrained greedy output token by token through a fresh matcher and
records, at each position, how many tokens the grammar allowed, a few of them, whether the
continuation was forced (jump-forward would have appended it) and which token was taken.
`mask_widget` lets a learner pick a schema or regex and watch it; `mask_table` is its text form.
"""

from __future__ import annotations

import ipywidgets as widgets

from llmopt.sampling_params import SamplingParams
from llmopt.structured.bitmask import unpack_bitmask
from llmopt.structured.matcher import RequestGrammar
from llmopt.structured.params import StructuredOutputsParams
from llmopt.viz.notebook import LessonWidget, format_table, show_outputs

EXAMPLES = {
    "JSON schema: a person": StructuredOutputsParams(json={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "role": {"enum": ["admin", "guest"]}},
        "required": ["name", "age", "role"]}),
    "regex: a date": StructuredOutputsParams(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
    "choice: yes / no / maybe": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
}


def mask_steps(llm, so: StructuredOutputsParams, prompt: str = "x =", max_tokens: int = 48) -> list[dict]:
    """One row per output token of a constrained greedy run: the allowed set before it was
    chosen, and whether the grammar forced the text there."""
    import xgrammar as xgr

    engine = llm.llm_engine
    jump = engine.structured.enable_jump_forward
    engine.structured.enable_jump_forward = False  # every token sampled: each one gets its row
    try:
        [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      structured_outputs=so), use_tqdm=False)
    finally:
        engine.structured.enable_jump_forward = jump
    vocab = engine.model_config.vocab_size
    g = RequestGrammar(engine.structured.compile(SamplingParams(structured_outputs=so)), engine.eos_token_ids, vocab)
    bitmask, tok, rows = xgr.allocate_token_bitmask(1, vocab), llm.tokenizer, []
    for i, t in enumerate(out.outputs[0].token_ids):
        g.fill(bitmask, 0)
        allowed = unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist()
        forced = g.matcher.find_jump_forward_string()
        rows.append({"step": i, "allowed": len(allowed),
                     "some allowed": " ".join(repr(tok.decode([a])) for a in allowed[:4]),
                     "forced text": repr(forced) if forced else "",
                     "chosen": repr(tok.decode([t])) if t not in engine.eos_token_ids else "EOS"})
        g.accept(t)
    return rows


def mask_table(rows: list[dict]) -> str:
    return format_table(rows, columns=["step", "allowed", "chosen", "forced text", "some allowed"])


def mask_widget(llm, prompt: str = "x =") -> LessonWidget:
    """Pick a constraint (or type a regex) and see the allowed set at each step."""
    pick = widgets.Dropdown(options=list(EXAMPLES), description="constraint")
    regex = widgets.Text(value="", placeholder="or type a regex, e.g. [a-z]{3}-[0-9]{2}", description="regex")
    out = widgets.Output()

    def redraw(_=None):
        try:
            so = StructuredOutputsParams(regex=regex.value) if regex.value else EXAMPLES[pick.value]
            rows = mask_steps(llm, so, prompt)
            text = mask_table(rows)
        except ValueError as e:
            text = f"refused: {e}"
        show_outputs(out, text)

    pick.observe(redraw, "value")
    regex.observe(redraw, "value")
    redraw()
    return LessonWidget("allowed tokens step by step", [widgets.HBox([pick, regex]), out])
