"""The block manager: KV memory as a pool of fixed-size blocks (PagedAttention).

A sequence's KV cache is not one contiguous strip but a list of blocks, each holding
`block_size` tokens, found through the sequence's *block table*. Blocks are handed out
as tokens arrive, so memory is reserved for at most `block_size - 1` tokens a sequence
does not use, instead of its whole `max_model_len`.

Prefix caching rides on the same blocks. A full block is named by a hash of its tokens
chained to the hash of the block before it (as vLLM does), so equal hashes mean equal
prefixes. A new request first looks its full blocks up by hash and shares what it finds
(ref count + 1) instead of recomputing it. A block whose ref count drops to 0 keeps its
contents and hash and joins the free queue; it is evicted (its hash forgotten) only when
the pool reuses it, least recently freed first. (radix_cache.py keeps the same blocks in
SGLang's radix tree instead, matched to the token: `prefix_cache="radix"`.)

Per-block state lives in flat arrays indexed by block id, not in an object per block: a
million blocks take 0.1 s and 28 MB to set up (with an object each: 1.3 s and 260 MB).
"""

from __future__ import annotations

from array import array

# RAM the arrays take per block: ref count (4), hash slot (8), free-queue links (8 + 8)
HOST_BYTES_PER_BLOCK = 28


class FreeBlockQueue:
    """Free block ids, least recently freed first (vLLM's FreeKVCacheBlockQueue): a doubly
    linked list threaded through two arrays, `next` and `prev`, so that taking the front,
    appending, and taking a block out of the middle (a prefix-cache hit on a free block) are
    each O(1). Index `num_blocks` is the list's sentinel: its next is the front, its prev the back."""

    def __init__(self, num_blocks: int):
        self.end = num_blocks
        self.next = array("q", range(1, num_blocks + 2))  # block i -> i + 1, the last -> the sentinel
        self.prev = array("q", range(-1, num_blocks))
        self.next[self.end], self.prev[0] = 0, self.end   # the sentinel -> block 0 -> ...
        self.num_free = num_blocks

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self):
        b = self.next[self.end]
        while b != self.end:
            yield b
            b = self.next[b]

    def popleft(self) -> int:
        b = self.next[self.end]
        assert b != self.end, "no free block"
        self.remove(b)
        return b

    def remove(self, b: int) -> None:
        before, after = self.prev[b], self.next[b]
        self.next[before], self.prev[after] = after, before
        self.num_free -= 1

    def append(self, b: int) -> None:
        last = self.prev[self.end]
        self.next[last], self.prev[b] = b, last
        self.next[b], self.prev[self.end] = self.end, b
        self.num_free += 1


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chain hash: a block's identity is its tokens *and* everything before them."""
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = array("i", [0]) * num_blocks        # block tables each block sits in
        self.block_hash: list[int | None] = [None] * num_blocks  # set once full and its tokens known
        # Free blocks, least recently freed first. Popping from the front evicts the
        # coldest cached block; a cache hit on a free block takes it out of the middle.
        self.free_queue = FreeBlockQueue(num_blocks)
        self.cached: dict[int, int] = {}         # block hash -> block id
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}  # hashes of each sequence's full blocks
        # counters the metrics and the trace read
        self.prefix_queries = self.prefix_hits = 0    # in tokens, as vLLM counts them
        self.step_allocated: list[int] = []
        self.step_freed: list[int] = []

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks held by running sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookup -------------------------------------------------------------------
    def find_cached_prefix(self, seq_id: str, token_ids: list[int]) -> list[int]:
        """Blocks already holding this sequence's leading full blocks.

        At most `len(token_ids) - 1` tokens may hit: the last token must be computed
        anyway, because its logits are what the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        max_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            h = hash_block(parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def num_cached_tokens(self, cached: list[int]) -> int:
        """Tokens a lookup's result covers (the radix cache's may end inside a block)."""
        return len(cached) * self.block_size

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """How many tokens of `token_ids` a lookup now would find (longest-prefix-match scheduling)."""
        return self.num_cached_tokens(self.find_cached_prefix("", token_ids))

    # (src, dst) blocks to copy before the next forward: the hash cache shares whole blocks only
    # and never copies (the radix cache copies partly matched ones)
    pending_copies: tuple | list[tuple[int, int]] = ()  # (a tuple: a class attribute no instance can append to)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copies pending (emptied): the engine makes them before the next forward."""
        copies, self.pending_copies = list(self.pending_copies), []
        return copies

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def cached_block_ids(self) -> list[int]:
        return [b for b, h in enumerate(self.block_hash) if h is not None]

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted when a request is admitted, not at every attempt while it waits."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------------
    def can_allocate(self, seq_id: str, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        have = len(self.block_tables.get(seq_id, ())) + len(cached_blocks)
        new = max(0, -(-num_tokens // self.block_size) - have)  # blocks_needed(num_tokens), inline: every step asks
        # a cache hit on a free block takes it off the free queue too
        reused_free = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)
        return new + reused_free <= self.free_queue.num_free

    def allocate(self, seq_id: str, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make the sequence's block table cover `num_tokens` tokens. False if memory is short
        (then nothing changes)."""
        if not self.can_allocate(seq_id, num_tokens, cached_blocks):
            return False
        table = self.block_tables.setdefault(seq_id, [])
        hashes = self.block_hashes.setdefault(seq_id, [])
        for b in cached_blocks:
            if self.ref_cnt[b] == 0:
                self.free_queue.remove(b)
            self.ref_cnt[b] += 1
            table.append(b)
            hashes.append(self.block_hash[b])
        need = -(-num_tokens // self.block_size)  # blocks_needed(num_tokens)
        while len(table) < need:
            table.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        block_id = self.free_queue.popleft()
        h = self.block_hash[block_id]
        if h is not None:  # evict: its contents are about to be overwritten
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.block_hash[block_id] = None
        self.ref_cnt[block_id] = 1
        self.step_allocated.append(block_id)
        return block_id

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Free the tail blocks a sequence no longer needs (rejected speculative tokens)."""
        table = self.block_tables.get(seq_id, [])
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self._release(table.pop())
        hashes = self.block_hashes.get(seq_id)
        if hashes is not None and len(hashes) > len(table):
            del hashes[len(table):]

    def cache_full_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register every block whose `block_size` tokens are now all computed."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.block_tables[seq_id], self.block_hashes[seq_id]
        full = min(num_computed // self.block_size, len(table))
        for i in range(len(hashes), full):
            parent = hashes[i - 1] if i else None
            h = hash_block(parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            hashes.append(h)
            b = table[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks. Tail blocks are freed first, so they are evicted
        before the shared prefix blocks that other requests are more likely to reuse."""
        table = self.block_tables.pop(seq_id, [])
        self.block_hashes.pop(seq_id, None)
        for b in reversed(table):
            self._release(b)

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unreferenced block joins the free queue (keeping its hash)."""
        self.ref_cnt[block_id] -= 1
        assert self.ref_cnt[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_cnt[block_id] == 0:
            self.free_queue.append(block_id)
            self.step_freed.append(block_id)

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.ref_cnt[b] == 0:
                self.block_hash[b] = None
                del self.cached[h]

    # -- invariants (the property tests call this) ----------------------------------------------
    def check_invariants(self) -> None:
        held: dict[int, int] = {}
        for table in self.block_tables.values():
            for b in table:
                held[b] = held.get(b, 0) + 1
        free = list(self.free_queue)
        assert len(free) == len(set(free)) == len(self.free_queue), "free queue"
        free = set(free)
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] == held.get(b, 0), f"block {b} ref count"
            assert (self.ref_cnt[b] == 0) == (b in free), f"block {b}"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
