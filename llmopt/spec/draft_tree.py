"""A draft tree as the target verifies it: flat order, positions by depth, the tree mask.

An EAGLE-2 proposer (llmopt/spec/tree.py) drafts a tree; the target reads it in one step.
Node i sits at position (last token's position + its depth) and attends to the committed
context plus its own ancestors only (`tree_mask`), so every node sees exactly the sequence
it would end. The nodes take the slots after the last token in flat order (parents before
children); after verification the accepted path's keys and values are moved into the slots
of their positions (`accepted_slot_moves`, `move_slots`), and the rest of the tree's slots
are trimmed with the sequence's tail blocks like any rejected draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.layers.attention import AttentionMetadata, slots_of


@dataclass
class DraftTree:
    """A draft tree in flat order: node i has `tokens[i]`, its parent `parents[i]` (-1: the
    root, i.e. the sequence's last token; otherwise an earlier node) and `depths[i]` >= 1.
    Siblings come in the head's order of preference."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            kids.setdefault(p, []).append(i)
        return kids


def ancestor_matrix(parents: list[int], device="cpu") -> torch.Tensor:
    """Boolean [n + 1, n + 1] over (root, nodes...): True where column j is row i or one of its
    ancestors. The root is everyone's ancestor."""
    n = len(parents)
    m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    m[:, 0] = True
    for i, p in enumerate(parents):
        m[i + 1] = m[p + 1] if p >= 0 else m[0]  # a parent's row is complete before its child's
        m[i + 1, i + 1] = True
    return m.to(device)


def tree_mask(context: int, parents: list[int], device="cpu") -> torch.Tensor:
    """Boolean [n + 1, context + n + 1]: the root and n nodes, after `context` committed keys,
    each seeing all of the context, and of the tree only itself and its ancestors."""
    tree = ancestor_matrix(parents, device)
    return torch.cat([torch.ones(len(parents) + 1, context, dtype=torch.bool, device=device), tree], dim=1)


# The kernels take a tree's mask as one int64 per query row over its sequence's last 64 keys
# (bit j: the key at seq_len - 64 + j; every earlier key is seen): the root and 63 nodes fit.
MASK_KEYS = 64
MAX_KERNEL_NODES = MASK_KEYS - 1


def mask_bits(mask: torch.Tensor) -> list[int]:
    """A boolean [rows, m] mask over a sequence's last m <= 64 keys, in the kernels' form."""
    rows, m = mask.shape
    if m > MASK_KEYS:
        raise ValueError(f"a kernel mask covers the last {MASK_KEYS} keys, got {m}")
    out, before = [], (1 << (MASK_KEYS - m)) - 1  # the keys before those m: always seen
    for row in mask.tolist():
        v = before + sum(1 << (MASK_KEYS - m + j) for j, seen in enumerate(row) if seen)
        out.append(v - (1 << 64) if v >= 1 << 63 else v)  # as a signed int64
    return out


def tree_bits(parents: list[int]) -> list[int]:
    """The verification rows (root, nodes...) of a tree: each sees the root and its ancestors."""
    return mask_bits(ancestor_matrix(parents))


def add_tree_layout(meta: AttentionMetadata, trees: list[DraftTree | None]) -> None:
    """Turn a paged step into a tree-verification step: for each sequence with a tree, its new
    tokens are (last token, tree nodes...), at positions (context + depth), under the tree mask.
    Sequences without a tree keep causal attention (mask None)."""
    if all(t is None for t in trees):
        return
    positions = meta.positions.clone()
    masks, bits, start = [], [], 0
    for tree, ctx, n in zip(trees, meta.context_lens, meta.query_lens):
        if tree is None:
            masks.append(None)
            bits += [-1] * n
        else:
            if n != len(tree) + 1:
                raise ValueError(f"a tree of {len(tree)} nodes is verified with its last token: "
                                 f"{len(tree) + 1} new tokens, got {n}")
            positions[start:start + n] = ctx + torch.tensor([0] + tree.depths, device=positions.device)
            masks.append(tree_mask(ctx, tree.parents, positions.device))
            bits += tree_bits(tree.parents)
        start += n
    meta.positions = positions
    meta.tree_masks = masks
    # the kernels' form of the same masks; a tree past MAX_KERNEL_NODES takes the torch path
    fits = all(t is None or len(t) <= MAX_KERNEL_NODES for t in trees)
    meta.tree_bits = torch.tensor(bits, dtype=torch.int64, device=positions.device) if fits else None


def accepted_path(tree: DraftTree, emitted: list[int]) -> list[int]:
    """Node indices of the accepted drafts: emitted[:-1] read down from the root."""
    kids, node, path = tree.children(), -1, []
    for token in emitted[:-1]:
        node = next(c for c in kids.get(node, []) if tree.tokens[c] == token)
        path.append(node)
    return path


def accepted_slot_moves(table: list[int], num_tokens: int, path: list[int],
                        block_size: int) -> tuple[list[int], list[int]]:
    """(source, destination) slots that put the accepted path where its positions belong.

    The last token (position num_tokens - 1) verified in slot num_tokens - 1, node i in slot
    num_tokens + i; the path's j-th node (depth j) belongs in slot num_tokens - 1 + j. Parents
    come before children in flat order, so a node's index is at least its depth - 1: sources
    never lie below their destinations, and one gather-then-scatter moves them all."""
    src, dst = [], []
    for j, node in enumerate(path, start=1):
        if node != j - 1:
            src.append(num_tokens + node)
            dst.append(num_tokens - 1 + j)
    return slots_of(table, src, block_size), slots_of(table, dst, block_size)


def move_slots(cache, src: list[int], dst: list[int]) -> None:
    """Copy every layer's keys and values from slots `src` to slots `dst` of a paged pool. An
    int8 / int4 pool's codes mean something only with their block's key groups, so there each
    slot is read back and written again at its new place (llmopt/kernels/int_kv_ref.py)."""
    if not src:
        return
    s = torch.tensor(src, device=cache.k[0].device)
    d = torch.tensor(dst, device=cache.k[0].device)
    bits = getattr(cache, "int_bits", None)
    if bits is not None:
        from llmopt.kernels.int_kv_ref import read_keys, read_values, write_int_kv

        rows, bs = torch.arange(len(src), device=s.device), cache.block_size
        for layer in range(len(cache.k)):   # every source read before any destination is written
            k = read_keys(cache.k[layer], cache.k_scales[layer], s // bs, bits)[rows, s % bs]
            v = read_values(cache.v[layer], cache.v_scales[layer], s // bs, bits)[rows, s % bs]
            write_int_kv(k, v, cache.k[layer], cache.v[layer], cache.k_scales[layer], cache.v_scales[layer], d, bits)
        return
    for pool in (*cache.k, *cache.v):
        flat = pool.view(-1, *pool.shape[2:])
        flat[d] = flat[s]
