"""SGLang's radix-tree prefix cache (RadixAttention), on the same paged block pool.

Every prefix the engine has computed is a path in a tree over token ids: a node holds a run of
tokens (the edge into it) and the blocks that hold their keys and values. A new request walks the
tree from the root and reuses the longest matching path *to the token*, where the hash cache
(block_manager.py) stops at the last whole block; a node is split where two requests part. Leaves
no running request uses are evicted least recently used first, and `scheduling_policy="lpm"`
(scheduler.py) admits the waiting request with the longest cached prefix first.

The pool stays paged, so a match that ends inside a block needs a decision. Per-token slot
references (SGLang's page size 1) would need a block table per token, which the paged attention
kernels do not read; and the new request cannot write into the cached block itself, whose later
slots belong to the cached continuation. So the block is copied (copy-on-write, as vLLM's first
block manager did for beam search): a fresh block takes the cached one's slots before the step's
forward, and the request writes its own tokens after the matched ones. One block copy, through
every layer, instead of recomputing up to block_size - 1 tokens through every layer.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from llmopt.engine.block_manager import BlockManager


class RadixNode:
    """Tokens `key` at positions start..end-1, and the blocks covering those positions (block
    index start // block_size onwards). When a node starts inside a block, its first block is
    either its parent's last one (`owns_first` False: a split left both halves in one block) or
    its own copy; every block belongs to exactly one node, which holds it in the tree."""

    __slots__ = ("key", "start", "blocks", "owns_first", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], start: int, blocks: list[int], owns_first: bool, parent):
        self.key, self.start, self.blocks, self.owns_first, self.parent = key, start, blocks, owns_first, parent
        self.children: dict[int, RadixNode] = {}  # first token of the child's key -> child
        self.lock_ref = 0     # running requests whose cached path passes through this node
        self.last_access = 0  # the cache's clock when a request last used it (LRU)

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def owned(self) -> list[int]:
        return self.blocks if self.owns_first else self.blocks[1:]


@dataclass
class RadixMatch:
    """What a lookup found: `num_tokens` cached tokens, the whole blocks to share, the deepest
    node matched to its end, a node matched only partway (node, tokens matched; split when the
    request is admitted), and the block to copy when the match ends inside a block."""

    num_tokens: int
    blocks: list[int]
    node: RadixNode
    partial: tuple[RadixNode, int] | None
    copy_src: int | None

    def __bool__(self) -> bool:
        return self.num_tokens > 0


def _common_len(key: list[int], tokens: list[int], at: int, limit: int) -> int:
    """How many leading tokens of `key` equal tokens[at:limit]."""
    n = min(len(key), limit - at)
    if key[:n] == tokens[at:at + n]:  # the usual case, compared in C
        return n
    i = 0
    while key[i] == tokens[at + i]:
        i += 1
    return i


class RadixCache(BlockManager):
    """The block manager with a radix tree for its prefix cache (`prefix_cache="radix"`).

    `ref_cnt` still counts block tables; a block the tree holds has `in_tree` set and leaves the
    pool only when its node is evicted. Free blocks for allocation = the free queue + the blocks
    of unlocked nodes (`num_evictable`), which eviction hands back leaf by leaf."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.root = RadixNode([], 0, [], True, None)
        self.in_tree = bytearray(num_blocks)
        self.num_tree_blocks = 0
        self.num_evictable = 0
        self.last_node: dict[str, RadixNode] = {}  # request -> deepest node of its cached path
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) blocks, done before the forward
        self._clock = 0

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self.num_tree_blocks

    def cached_block_ids(self) -> list[int]:
        return [b for b in range(self.num_blocks) if self.in_tree[b]]

    def num_cached_tokens(self, cached) -> int:
        return cached.num_tokens if cached else 0

    # -- lookup --------------------------------------------------------------------------------
    def find_cached_prefix(self, seq_id: str, token_ids: list[int]) -> RadixMatch:
        """The longest cached prefix of `token_ids`, to the token (but never the last token,
        whose logits must be computed). Changes nothing: a request not admitted now looks again."""
        bs = self.block_size
        limit = len(token_ids) - 1
        if self.blocks_needed(len(token_ids)) >= self.num_blocks:
            limit -= limit % bs  # no room for a copy beside its source: whole blocks only
        node, m, table, partial = self.root, 0, [], None
        while m < limit and (child := node.children.get(token_ids[m])) is not None:
            k = _common_len(child.key, token_ids, m, limit)
            first = child.start // bs
            del table[first:]  # a deeper node's copy of a boundary block holds the parent's slots too
            table += child.blocks[:(m + k - 1) // bs - first + 1]
            m += k
            if k < len(child.key):
                partial = (child, k)
                break
            node = child
        return RadixMatch(m, table[:m // bs], node, partial, table[m // bs] if m % bs else None)

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        return self.find_cached_prefix("", token_ids).num_tokens

    # -- allocation ----------------------------------------------------------------------------
    def can_allocate(self, seq_id: str, num_tokens: int, cached=None) -> bool:
        have = len(self.block_tables.get(seq_id, ())) + (len(cached.blocks) if cached else 0)
        new = max(0, self.blocks_needed(num_tokens) - have)
        pinned = self._newly_pinned(cached) if cached and seq_id not in self.last_node else 0
        return new <= self.num_free_blocks - pinned

    def _newly_pinned(self, match: RadixMatch) -> int:
        """Blocks that locking the match's path takes out of the evictable ones."""
        pinned, node = 0, match.node
        if match.partial is not None and match.partial[0].lock_ref == 0:
            child, k = match.partial
            upper = (child.start + k - 1) // self.block_size - child.start // self.block_size + 1
            pinned += upper - (0 if child.owns_first else 1)
        while node is not self.root and node.lock_ref == 0:
            pinned += len(node.owned())
            node = node.parent
        return pinned

    def allocate(self, seq_id: str, num_tokens: int, cached=None) -> bool:
        if not self.can_allocate(seq_id, num_tokens, cached):
            return False
        table = self.block_tables.setdefault(seq_id, [])
        admitted = seq_id not in self.last_node
        if admitted:  # lock the cached path before anything is evicted
            node = self.root
            if cached:
                node = self._split(*cached.partial) if cached.partial else cached.node
                for b in cached.blocks:
                    self.ref_cnt[b] += 1
                    table.append(b)
            self._lock(node)
            self._touch(node)
            self.last_node[seq_id] = node
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self._pop_free())
        if admitted and cached and cached.copy_src is not None:
            self.pending_copies.append((cached.copy_src, table[cached.num_tokens // self.block_size]))
        return True

    def _pop_free(self) -> int:
        if not len(self.free_queue):
            self._evict(1)
        block_id = self.free_queue.popleft()
        self.ref_cnt[block_id] = 1
        self.step_allocated.append(block_id)
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_cnt[block_id] -= 1
        assert self.ref_cnt[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_cnt[block_id] == 0 and not self.in_tree[block_id]:
            self.free_queue.append(block_id)
            self.step_freed.append(block_id)

    def free(self, seq_id: str) -> None:
        node = self.last_node.pop(seq_id, None)
        if node is not None:
            self._unlock(node)
        table = self.block_tables.pop(seq_id, [])
        # admitted and preempted in the same step: its copy must not land in a reused block
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in table]
        for b in reversed(table):
            self._release(b)

    # -- insertion -----------------------------------------------------------------------------
    def cache_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Insert every computed token (partial blocks too), from where the request's cached
        path ends; its lock moves down to the new end."""
        old = node = self.last_node.get(seq_id)
        if node is None:
            return
        table = self.block_tables[seq_id]
        pos, end = node.end, min(num_computed, len(table) * self.block_size)
        while pos < end:
            child = node.children.get(token_ids[pos])
            if child is None:
                node = self._add_tokens(node, token_ids[pos:end], table, node is old)
                break
            k = _common_len(child.key, token_ids, pos, end)
            if k < len(child.key):
                if pos + k == end:
                    break  # already cached (another request ran ahead with the same tokens)
                child = self._split(child, k)
            node, pos = child, pos + k
        if node is not old:
            self._lock(node)
            self._unlock(old)
            self.last_node[seq_id] = node
        self._touch(node)

    def _add_tokens(self, node: RadixNode, tokens: list[int], table: list[int], mine: bool) -> RadixNode:
        bs = self.block_size
        start = node.end
        blocks = table[start // bs:(start + len(tokens) - 1) // bs + 1]
        shares_first = start % bs != 0 and blocks[0] == node.blocks[-1]
        if mine and node is not self.root and not node.children and node.lock_ref == 1 and (
                start % bs == 0 or shares_first):
            # this request's own leaf: grow it in place rather than chain a node per decode step
            new = blocks[1:] if shares_first else blocks
            node.key += tokens
            node.blocks += new
            self._own(new, locked=True)
            return node
        child = RadixNode(list(tokens), start, blocks, not shares_first, node)
        node.children[tokens[0]] = child
        self._own(child.owned(), locked=False)
        return child

    def _split(self, child: RadixNode, k: int) -> RadixNode:
        """Cut `child` after k tokens; the new upper node takes its place. The lower part stays the
        same object, so requests whose path ends there still point at the right node."""
        bs = self.block_size
        cut, first = child.start + k, child.start // bs
        upper = RadixNode(child.key[:k], child.start, child.blocks[:(cut - 1) // bs - first + 1],
                          child.owns_first, child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[0]] = upper
        child.key, child.start, child.parent = child.key[k:], cut, upper
        child.blocks = child.blocks[cut // bs - first:]
        child.owns_first = cut % bs == 0  # inside a block: that block stays the upper node's
        upper.children[child.key[0]] = child
        return upper

    def _own(self, blocks: list[int], locked: bool) -> None:
        for b in blocks:
            assert not self.in_tree[b], f"block {b} already in the tree"
            self.in_tree[b] = 1
        self.num_tree_blocks += len(blocks)
        self.num_evictable += 0 if locked else len(blocks)

    def _lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_evictable -= len(node.owned())
            node.lock_ref += 1
            node = node.parent

    def _unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable += len(node.owned())
            node = node.parent

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    # -- eviction ------------------------------------------------------------------------------
    def _evict(self, num_blocks: int) -> None:
        """Free at least `num_blocks` blocks by evicting unlocked leaves, least recently used
        first; a parent left childless and unlocked becomes a candidate in turn."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            self._evicting(leaf)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            for b in leaf.owned():
                assert self.ref_cnt[b] == 0, f"evicting block {b}, still in a block table"
                self.in_tree[b] = 0
                self.free_queue.append(b)
                self.step_freed.append(b)
            freed += len(leaf.owned())
            self.num_tree_blocks -= len(leaf.owned())
            self.num_evictable -= len(leaf.owned())
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _evicting(self, leaf: RadixNode) -> None:
        """Called as `leaf` leaves the tree, its blocks still intact (the offload tier keeps them)."""

    def reset_prefix_cache(self) -> None:
        self._evict(self.num_blocks)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack += node.children.values()
            yield node

    # -- invariants (the tests call this) -------------------------------------------------------
    def check_invariants(self) -> None:
        bs, held = self.block_size, {}
        for table in self.block_tables.values():
            for b in table:
                held[b] = held.get(b, 0) + 1
        free = list(self.free_queue)
        assert len(free) == len(set(free)) == len(self.free_queue), "free queue"
        owner, locks = {}, {}
        for node in self.last_node.values():
            while node is not self.root:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent
        evictable = 0
        for node in self._nodes():
            assert node.key and node.parent.children[node.key[0]] is node, "child index"
            assert node.start == node.parent.end, "positions run on from the parent"
            assert len(node.blocks) == (node.end - 1) // bs - node.start // bs + 1, "blocks cover the tokens"
            if not node.owns_first:
                assert node.start % bs and node.blocks[0] == node.parent.blocks[-1], "borrowed block"
            assert node.lock_ref == locks.get(id(node), 0), "lock count"
            for b in node.owned():
                assert b not in owner and self.in_tree[b], f"block {b} owned twice"
                owner[b] = node
                assert node.lock_ref or not held.get(b), f"block {b}: in a table, its node unlocked"
            evictable += 0 if node.lock_ref else len(node.owned())
        assert set(owner) == {b for b in range(self.num_blocks) if self.in_tree[b]}, "tree blocks"
        assert len(owner) == self.num_tree_blocks and evictable == self.num_evictable, "counters"
        free = set(free)
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] == held.get(b, 0), f"block {b} ref count"
            assert (self.ref_cnt[b] == 0 and not self.in_tree[b]) == (b in free), f"block {b}"
        for _, d in self.pending_copies:
            assert held.get(d), f"copy into block {d}, which no request holds"
