"""The radix-tree view: the prefix cache as SGLang keeps it, one node per run of shared tokens.

Each line is a node: the token positions it covers, a glimpse of its text, the blocks holding
its keys and values (a block in brackets is its parent's, shared where a split fell inside a
block), and how many running requests lock it. A request's cached prefix is a path from the root.
"""

from __future__ import annotations

from llmopt.engine.radix_cache import RadixCache, RadixNode


def _label(node: RadixNode, tokenizer, width: int) -> str:
    if tokenizer is None:
        shown = " ".join(map(str, node.key[:6])) + (" ..." if len(node.key) > 6 else "")
    else:
        text = tokenizer.decode(node.key)
        shown = repr(text if len(text) <= width else text[:width - 3] + "...")
    blocks = [f"({b})" if i == 0 and not node.owns_first else str(b) for i, b in enumerate(node.blocks)]
    lock = f", locked by {node.lock_ref}" if node.lock_ref else ""
    return f"[{node.start}, {node.end}) {len(node.key)} tokens {shown}  blocks {' '.join(blocks)}{lock}"


def tree_text(cache: RadixCache, tokenizer=None, width: int = 32) -> str:
    """The tree as indented text (children in the order their first token sorts)."""
    if not isinstance(cache, RadixCache):
        raise TypeError(f"tree_text draws the radix cache (prefix_cache='radix'), got {type(cache).__name__}")
    lines = [f"(root)  {cache.num_cached_blocks} blocks cached, {cache.num_evictable} of them evictable"]

    def walk(node: RadixNode, indent: str) -> None:
        kids = sorted(node.children.values(), key=lambda n: n.key[0])
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f"{indent}{'└── ' if last else '├── '}{_label(child, tokenizer, width)}")
            walk(child, indent + ("    " if last else "│   "))

    walk(cache.root, "")
    return "\n".join(lines)
