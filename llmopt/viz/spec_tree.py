"""Lesson 05's look inside EAGLE-2: the draft trees the proposer builds, and which path won.

`recording_trees(llm)` keeps every tree the engine's tree proposer drafts while a block
runs, with how many tokens its request had made by then. Under greedy decoding the path
the target accepts is the one that spells the request's next output tokens, so once
generation is done `accepted_nodes` finds it from the output alone, exactly as the tree
sampler walks it (llmopt/spec/tree_sampler.py, `accepted_path` in llmopt/spec/draft_tree.py).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import ipywidgets as widgets

from llmopt.sampling_params import SamplingParams
from llmopt.spec.draft_tree import DraftTree
from llmopt.spec.proposers import EagleTreeProposer
from llmopt.viz.notebook import LABEL_STYLE, LessonWidget, format_table, show_outputs
from llmopt.viz.spec import show_token


@dataclass
class DraftedTree:
    request_id: str
    made: int          # output tokens the request had when the tree was drafted
    tree: DraftTree


@contextmanager
def recording_trees(llm):
    """`with recording_trees(llm) as trees:` every tree drafted inside is appended to `trees`."""
    proposer = llm.llm_engine.proposer
    if not isinstance(proposer, EagleTreeProposer):
        raise ValueError("recording_trees needs an LLM with an EAGLE tree proposer: "
                         "speculative_config={'method': 'eagle', ..., 'tree': {...}}")
    trees: list[DraftedTree] = []
    original = proposer.propose

    def propose(seqs, ks, block_tables):
        out = original(seqs, ks, block_tables)
        trees.extend(DraftedTree(s.request_id, len(s.output_token_ids), s.spec_tree)
                     for s in seqs if s.spec_tree is not None)
        return out

    proposer.propose = propose  # an instance attribute shadows the method until the block ends
    try:
        yield trees
    finally:
        del proposer.propose


def accepted_nodes(drafted: DraftedTree, output_token_ids: list[int]) -> list[int]:
    """The nodes a greedy target accepted: the tree read down along the tokens that followed."""
    upcoming = list(output_token_ids[drafted.made:drafted.made + max(drafted.tree.depths) + 1])
    tree, kids, node, path = drafted.tree, drafted.tree.children(), -1, []
    for token in upcoming:
        nxt = next((c for c in kids.get(node, []) if tree.tokens[c] == token), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def tree_text(tree: DraftTree, tokenizer=None, accepted: list[int] = ()) -> str:
    """One line per node, indented under its parent, siblings in the head's order of preference;
    `*` marks the accepted path."""
    kids, lines = tree.children(), []

    def walk(node: int, depth: int) -> None:
        for child in kids.get(node, []):
            mark = "*" if child in accepted else " "
            lines.append(f"{mark} {'    ' * depth}{show_token(tokenizer, tree.tokens[child])!r}")
            walk(child, depth + 1)

    walk(-1, 0)
    return "\n".join(lines)


def tree_rows(trees: list[DraftedTree], outputs: dict[str, list[int]]) -> list[dict]:
    """Per drafted tree: nodes, depth, how wide each level is, and how many nodes were accepted."""
    rows = []
    for d in trees:
        widths = [d.tree.depths.count(level) for level in range(1, max(d.tree.depths) + 1)]
        rows.append({"request": d.request_id, "after token": d.made, "nodes": len(d.tree),
                     "nodes per depth": " ".join(map(str, widths)),
                     "accepted": len(accepted_nodes(d, outputs[d.request_id]))})
    return rows


def tree_summary(trees: list[DraftedTree], outputs: dict[str, list[int]]) -> str:
    rows = tree_rows(trees, outputs)
    mean = sum(r["accepted"] for r in rows) / max(1, len(rows))
    return format_table(rows[:8]) + f"\n{len(rows)} trees, {mean:.2f} nodes accepted per tree on average"


def tree_widget(make_llm, request, head: str = "smollm2-eagle", top_k: int = 4, depth: int = 5,
                total_tokens: int = 16, max_tokens: int = 48) -> LessonWidget:
    """Turn EAGLE-2's knobs on a live request: tree width (`top_k`), depth (`num_speculative_tokens`)
    and node budget (`total_tokens`). Each change drafts with a fresh engine, `make_llm(speculative_config)`
    (SmolLM2 with its head `smollm2-eagle` in lesson 05), on `request` (chat messages, or a prompt),
    and shows the tree with the longest accepted path, the acceptance length, and the time per
    token against plain decoding's."""
    style = LABEL_STYLE
    width = widgets.IntSlider(value=top_k, min=1, max=6, description="top_k (width)", continuous_update=False,
                              style=style)
    deep = widgets.IntSlider(value=depth, min=1, max=7, description="depth", continuous_update=False, style=style)
    budget = widgets.IntSlider(value=total_tokens, min=2, max=48, step=2, description="total_tokens",
                               continuous_update=False, style=style)
    out = widgets.Output()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = {}

    def timed(llm):
        t0 = time.perf_counter()
        run = llm.chat if isinstance(request, list) else llm.generate
        res = run(request, params, use_tqdm=False)[0]
        return res, (time.perf_counter() - t0) / max(1, len(res.outputs[0].token_ids))

    def redraw(*_):
        if not plain:  # plain decoding's time per token, once
            plain["result"], plain["seconds"] = timed(make_llm(None))
        sc = {"method": "eagle", "model": head, "num_speculative_tokens": deep.value,
              "tree": {"top_k": width.value, "total_tokens": budget.value}}
        llm = make_llm(sc)
        with recording_trees(llm) as trees:
            res, seconds = timed(llm)
        ids = list(res.outputs[0].token_ids)
        best = max(trees, key=lambda t: len(accepted_nodes(t, ids)), default=None)
        m = llm.get_metrics()
        row = {"top_k": width.value, "depth": deep.value, "total_tokens": budget.value,
               "trees": len(trees), "acceptance length": 1 + m["spec_decode_num_accepted_tokens"]
               / max(1, m["spec_decode_num_drafts"]),
               "ms / token": 1e3 * seconds, "plain ms / token": 1e3 * plain["seconds"],
               "same text as plain": res.outputs[0].text == plain["result"].outputs[0].text}
        drawn = "" if best is None else (f"the tree with the longest accepted path ({len(accepted_nodes(best, ids))} "
                                         f"nodes, `*`), drafted after {best.made} output tokens:\n"
                                         + tree_text(best.tree, llm.tokenizer, accepted_nodes(best, ids)))
        show_outputs(out, format_table([row]), drawn)

    for w in (width, deep, budget):
        w.observe(redraw, names="value")
    redraw()
    return LessonWidget("EAGLE-2 tree: width, depth, budget", [widgets.HBox([width, deep, budget]), out])
