"""EAGLE-2's dynamic draft trees: the head drafts many continuations, the target checks them all.

A chain of k guesses is lost at its first wrong token. A tree keeps several guesses at each
step, spending them where the head is unsure: the root's `top_k` most likely children are
drafted; each depth, every drafted node offers its `top_k` children, scored by the product of
the head's probabilities along their path, and the `top_k` best are fed to the head again,
down to `num_speculative_tokens` levels. Of all candidates the `total_tokens` best are kept
(a child never scores above its parent, so they form a tree) and verified in one target
forward under a tree mask (llmopt/spec/draft_tree.py, llmopt/spec/tree_sampler.py).

The head drafts over the same paged cache, with the same masks: each drafted node attends to
the committed context plus its own ancestors. Its drafting KV lives in the sequence's
lookahead slots and is recomputed with true features once the target has decided.

    speculative_config={"method": "eagle", "model": "smollm2-eagle", "num_speculative_tokens": 5,
                        "tree": {"top_k": 4, "total_tokens": 16}}

Without "tree" the EAGLE proposer drafts a chain (llmopt/spec/proposers.py).
"""

from __future__ import annotations

import torch

from llmopt.layers.attention import AttentionMetadata
from llmopt.sequence import Sequence
from llmopt.spec.draft_tree import MASK_KEYS, DraftTree, ancestor_matrix, mask_bits


def check_tree_config(tree, depth: int) -> dict:
    """The `speculative_config["tree"]` of an EAGLE proposer, checked, with defaults filled:
    {"top_k": children per node and nodes expanded per depth, "total_tokens": the node budget}.
    """
    if not isinstance(tree, dict):
        raise TypeError(f"speculative_config['tree'] must be a dict like {{'top_k': 4, 'total_tokens': 16}}, "
                        f"got {tree!r}")
    unknown = set(tree) - {"top_k", "total_tokens"}
    if unknown:
        raise ValueError(f"speculative_config['tree']: unknown keys {sorted(unknown)}; allowed: top_k, total_tokens")
    out = {"top_k": tree.get("top_k", 4), "total_tokens": tree.get("total_tokens", 16)}
    for key, value in out.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config['tree']['{key}'] must be a positive integer, got {value!r}")
    most = max_tree_nodes(out["top_k"], depth)
    if out["total_tokens"] > most:
        raise ValueError(f"speculative_config['tree']['total_tokens']={out['total_tokens']} exceeds the "
                         f"{most} nodes a tree of top_k={out['top_k']} and depth {depth} can draft "
                         f"(top_k + (depth - 1) * top_k**2); allowed: 1..{most}")
    return out


def max_tree_nodes(top_k: int, depth: int) -> int:
    """Candidates drafted: top_k children of the root, then top_k of each of top_k nodes per depth."""
    return top_k + (depth - 1) * top_k * top_k


def select_tree(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """The `budget` best candidates (by path score), ancestors always included, in flat order.

    Candidates come in creation order (a parent before its children), `parents` indexing
    the same list (-1: the root)."""
    order = sorted(range(len(tokens)), key=lambda i: -scores[i])  # stable: ties keep parents first
    kept: set[int] = set()
    for i in order:
        if len(kept) == budget:
            break
        if parents[i] == -1 or parents[i] in kept:
            kept.add(i)
    depth = {}
    for i in sorted(kept):  # creation order: a parent's depth is known before its child's
        depth[i] = 1 if parents[i] == -1 else depth[parents[i]] + 1
    flat = sorted(kept, key=lambda i: (depth[i], -scores[i]))
    where = {c: n for n, c in enumerate(flat)}
    return DraftTree([tokens[i] for i in flat], [-1 if parents[i] == -1 else where[parents[i]] for i in flat],
                     [depth[i] for i in flat])


def draft_trees(proposer, seqs: list[Sequence], depths: list[int], top_k: int, budgets: list[int],
                block_tables: dict[str, list[int]]) -> list[DraftTree]:
    """EAGLE-2's drafting for a batch: one tree per sequence, of depth depths[i] and at most
    budgets[i] nodes, in the lookahead slots of `block_tables`. `proposer` is an EagleProposer
    (its head, KV pool, features, catch-up)."""
    bs, dev, K = proposer.block_size, proposer.device, top_k
    tables = [block_tables[s.request_id] for s in seqs]
    # 1. catch up on the tokens the head has not seen (true features), as the chain does
    starts = [proposer.valid_prefix(s) for s in seqs]
    feeds = [s.token_ids[v:] for s, v in zip(seqs, starts)]
    meta = AttentionMetadata.paged(tables, starts, [len(f) for f in feeds], bs, dev)
    last = torch.cumsum(torch.tensor([len(f) for f in feeds], device=dev), 0) - 1
    ids = torch.tensor([t for f in feeds for t in f], device=dev)
    logits, feats = proposer.draft_forward(ids, meta, seqs, starts, list(range(len(seqs))), None, last,
                                           block_tables)
    for s in seqs:
        proposer.fed[s.request_id] = (s.num_preemptions, list(s.token_ids))
    # candidates per sequence, in creation order: token, parent (-1 root), path log-prob
    tokens, parents, scores = [[] for _ in seqs], [[] for _ in seqs], [[] for _ in seqs]
    fronts, node_feats = [], {}  # nodes the head expands next; their parents' features
    top = logits.float().log_softmax(-1).topk(K, dim=-1)
    for b in range(len(seqs)):
        tokens[b] += top.indices[b].tolist()
        parents[b] += [-1] * K
        scores[b] += top.values[b].tolist()
        fronts.append(list(range(K)))
        node_feats[b, -1] = feats[b]
    fed: list[list[int]] = [[] for _ in seqs]  # nodes in the head's lookahead slots, in order
    # 2. each depth: feed the front, offer top_k children each, keep the best top_k as the next front
    for r in range(1, max(depths)):
        active = [b for b in range(len(seqs)) if depths[b] > r]
        ctx = [len(seqs[b]) + len(fed[b]) for b in active]
        meta = AttentionMetadata.paged([tables[b] for b in active], ctx, [K] * len(active), bs, dev)
        meta.positions = torch.tensor([len(seqs[b]) - 1 + r for b in active for _ in range(K)], device=dev)
        meta.tree_masks = [_front_mask(len(seqs[b]), fed[b], fronts[b], parents[b], dev) for b in active]
        if all(len(fed[b]) + K <= MASK_KEYS for b in active):  # the kernels' form: the drafted keys' bits
            meta.tree_bits = torch.tensor([x for b, m in zip(active, meta.tree_masks)
                                           for x in mask_bits(m[:, len(seqs[b]):])], device=dev)
        ids = torch.tensor([tokens[b][n] for b in active for n in fronts[b]], device=dev)
        prev = torch.stack([node_feats[b, parents[b][n]] for b in active for n in fronts[b]])
        out = proposer.head_forward(ids, prev, meta)
        top = proposer.draft_logits(out).log_softmax(-1).topk(K, dim=-1)
        for a, b in enumerate(active):
            fed[b] += fronts[b]
            new = []
            for j, n in enumerate(fronts[b]):
                node_feats[b, n] = out[a * K + j]
                row = top.values[a * K + j].tolist()
                new += [(scores[b][n] + v, t, n) for v, t in zip(row, top.indices[a * K + j].tolist())]
            first = len(tokens[b])
            for score, t, n in new:
                tokens[b].append(t)
                parents[b].append(n)
                scores[b].append(score)
            fronts[b] = sorted(range(first, len(tokens[b])), key=lambda c: -scores[b][c])[:K]
    return [select_tree(tokens[b], parents[b], scores[b], budgets[b]) for b in range(len(seqs))]


def _front_mask(context: int, fed: list[int], front: list[int], parents: list[int], device) -> torch.Tensor:
    """The front's mask: all `context` committed keys, and of the drafted nodes in the
    lookahead slots (`fed`, then the front itself) only each node's ancestors and itself."""
    order = fed + front
    where = {n: i for i, n in enumerate(order)}
    local = [-1 if parents[n] == -1 else where[parents[n]] for n in order]
    tree = ancestor_matrix(local, device)[1 + len(fed):, 1:]  # the front's rows, without the root column
    return torch.cat([torch.ones(len(front), context, dtype=torch.bool, device=device), tree], dim=1)
