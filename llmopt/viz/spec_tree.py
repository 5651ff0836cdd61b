"""Lesson 05's look inside EAGLE-2: the draft trees the proposer builds, and which path won.

`recording_trees(llm)` keeps every tree the engine's tree proposer drafts while a block
runs, with how many tokens its request had made by then. Under greedy decoding the path
the target accepts is the one that spells the request's next output tokens, so once
generation is done `accepted_nodes` finds it from the output alone, exactly as the tree
sampler walks it (llmopt/layers/tree_sampler.py, `accepted_path` in llmopt/worker/draft_tree.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from llmopt.spec.proposers import EagleTreeProposer
from llmopt.viz.notebook import format_table
from llmopt.viz.spec import show_token
from llmopt.worker.draft_tree import DraftTree


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

    def propose(seqs, ks):
        out = original(seqs, ks)
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
