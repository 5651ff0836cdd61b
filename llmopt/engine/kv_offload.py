"""The KV offload tier: blocks the prefix cache evicts wait below the pool for their next hit.

A prefix cache (block_manager.py, radix_cache.py) drops an evicted block for good: a returning
conversation whose context was pushed out recomputes it. LMCache and SGLang's HiCache keep such
blocks in a slower tier and copy them back on a hit; vLLM's native offloading
(`kv_offloading_size`, `kv_offloading_backend="native"`) does the same in host memory. Here:

- **Store.** When the pool evicts a full block (the hash cache reuses a free block that still
  had its hash; the radix cache drops a leaf), its bytes go to the first tier under the block's
  chained hash (its tokens and every token before them, block_manager.hash_block). A full tier
  moves its least recently used entry one tier down, or drops it from the last.
- **Find.** A prefix lookup that ends in the pool goes on in the tiers, block by block while
  the chain holds. The blocks found are loaded into fresh pool blocks instead of recomputed:
  a block read is a memory or disk copy, its recompute a forward through every layer.
- **Move, once a step.** The scheduler only decides; before the step's forward `store_evicted`
  copies the evicted blocks out (before anything overwrites them) and `load_claimed` copies the
  hits in, each row checked against the CRC-32 taken when it was stored. A row that fails (bytes
  changed, a file cut short) is dropped from the tier, never used: its request is preempted and
  recomputes those tokens (`move_blocks`).

Counted per tier: tokens loaded (`kv_offload_hits_<tier>`), blocks held, blocks refused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from llmopt.engine.block_manager import BlockManager, hash_block
from llmopt.engine.radix_cache import RadixCache
from llmopt.worker.kv_tier import BlockBytes, build_tiers, checksum


def prefix_hash(token_ids: list[int], num_blocks: int, block_size: int) -> int | None:
    """The chained hash of the first `num_blocks` full blocks (None for none)."""
    h = None
    for i in range(num_blocks):
        h = hash_block(h, tuple(token_ids[i * block_size:(i + 1) * block_size]))
    return h


class TierIndex:
    """What one tier holds: block hash -> (slot, CRC-32), least recently used first."""

    def __init__(self, store):
        self.store, self.name = store, store.kind
        self.entries: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.free = list(range(store.num_slots - 1, -1, -1))
        self.hit_tokens = 0


class KVOffload:
    """The tiers below one pool (`stores`, fastest first: llmopt/worker/kv_tier.py) and the copies
    the current step needs."""

    def __init__(self, stores: list, kv_cache, block_size: int):
        self.tiers = [TierIndex(s) for s in stores]
        self.remote: list[TierIndex] = []  # read-only tiers another engine wrote (llmopt/engine/kv_transfer.py)
        self.rows = BlockBytes(kv_cache)
        self.block_size = block_size
        self.stores: dict[int, int] = {}              # hash -> pool block evicted this step
        self.loads: list[tuple[int, TierIndex, int]] = []  # (hash, tier, pool block) claimed this step
        self.query_tokens = self.num_stored = self.num_dropped = self.num_refused = 0
        self.transfer_hit_tokens = 0  # loaded from transfer files since closed

    @property
    def all_tiers(self) -> list[TierIndex]:
        return self.tiers + self.remote

    def tier_of(self, h: int) -> int | None:
        return next((i for i, t in enumerate(self.all_tiers) if h in t.entries), None)

    def find(self, parent: int | None, token_ids: list[int], first: int, max_blocks: int) -> list[tuple[int, int]]:
        """(hash, tier) of blocks first, first + 1, ... found below the pool, while the chain holds."""
        bs, found = self.block_size, []
        for i in range(first, max_blocks):
            h = hash_block(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            tier = self.tier_of(h)
            if tier is None:
                break
            found.append((h, tier))
            parent = h
        return found

    # -- what the scheduler decides ------------------------------------------------------------
    def evicted(self, block: int, h: int) -> None:
        """The pool is about to reuse `block`, which holds the block hashed `h`."""
        if not self.tiers:  # only received prompts' files below (a decode engine): nowhere to store
            return
        tier = next((t for t in self.tiers if h in t.entries), None)
        if tier is None:
            self.stores[h] = block
        else:  # already below: now its most recently used entry
            tier.entries.move_to_end(h)

    def claim(self, loads: list[tuple[int, int]], blocks: list[int]) -> None:
        """Loads (hash, tier) into fresh pool `blocks` before the next forward."""
        tiers = self.all_tiers
        self.loads += [(h, tiers[tier], b) for (h, tier), b in zip(loads, blocks)]

    # -- what the step moves ---------------------------------------------------------------------
    def store_evicted(self) -> None:
        """Copy this step's evicted blocks into the first tier."""
        if self.stores:
            rows = self.rows.gather(list(self.stores.values()))
            loading = {h for h, _, _ in self.loads}  # entries this step's loads still need
            for h, row in zip(self.stores, rows):
                self._put(0, h, row, loading)
            self.stores = {}

    def _put(self, i: int, h: int, row: torch.Tensor, loading: set[int]) -> None:
        tier = self.tiers[i]
        if not tier.free:  # make room: the least recently used entry no load is waiting for
            victim = next((k for k in tier.entries if k not in loading), None)
            if victim is None:
                self.num_dropped += 1
                return
            slot, crc = tier.entries.pop(victim)
            if i + 1 < len(self.tiers):
                moved = torch.empty(self.rows.nbytes, dtype=torch.uint8)
                if tier.store.read(slot, moved) and checksum(moved) == crc:
                    self._put(i + 1, victim, moved, loading)
            else:
                self.num_dropped += 1
            tier.free.append(slot)
        slot = tier.free.pop()
        tier.store.write(slot, row)
        tier.entries[h] = (slot, checksum(row))
        self.num_stored += 1

    def load_claimed(self) -> set[int]:
        """Copy this step's claimed blocks into the pool; the pool blocks whose row failed its
        check (they hold nothing usable; their entries are gone from the tier)."""
        if not self.loads:
            return set()
        rows = torch.empty((len(self.loads), self.rows.nbytes), dtype=torch.uint8)
        good, failed = [], set()
        for k, (h, tier, block) in enumerate(self.loads):
            slot, crc = tier.entries[h]
            if tier.store.read(slot, rows[k]) and checksum(rows[k]) == crc:
                tier.entries.move_to_end(h)
                tier.hit_tokens += self.block_size
                good.append(k)
            else:
                del tier.entries[h]
                tier.free.append(slot)
                self.num_refused += 1
                failed.add(block)
        if good:
            self.rows.scatter([self.loads[k][2] for k in good], rows[good])
        self.loads = []
        return failed

    def reset(self) -> None:
        for tier in self.tiers:
            tier.free += [slot for slot, _ in tier.entries.values()]
            tier.entries.clear()

    def close(self) -> None:
        for tier in self.tiers:
            tier.store.close()

    def metrics(self) -> dict[str, float]:
        m = {"external_prefix_cache_queries": float(self.query_tokens),
             "external_prefix_cache_hits": float(sum(t.hit_tokens for t in self.all_tiers) + self.transfer_hit_tokens),
             "kv_offload_stored_blocks": float(self.num_stored),
             "kv_offload_dropped_blocks": float(self.num_dropped),
             "kv_offload_refused_blocks": float(self.num_refused)}
        for t in self.tiers:
            m[f"kv_offload_hits_{t.name}"] = float(t.hit_tokens)
            m[f"kv_offload_blocks_{t.name}"] = float(len(t.entries))
        if self.remote or self.transfer_hit_tokens:  # a disaggregated decode engine's received prompts
            m["kv_offload_hits_transfer"] = float(self.transfer_hit_tokens + sum(t.hit_tokens for t in self.remote))
        return m


@dataclass
class Offloaded:
    """A lookup that went on below the pool: `match` (the pool's part, the cache's own lookup
    result), then `loads` (hash, tier) for blocks `first`, `first` + 1, ... from the tiers."""

    match: object
    first: int
    loads: list[tuple[int, int]]


class OffloadingCache:
    """Mixed into a prefix cache (first in the bases): its evictions go to the tiers, its lookups
    go on into them. `offload` (a KVOffload) is set once the pool exists."""

    offload: KVOffload
    _loaded_tokens = 0

    def find_cached_prefix(self, seq_id: str, token_ids: list[int]):
        match = super().find_cached_prefix(seq_id, token_ids)
        bs = self.block_size
        first, max_blocks = super().num_cached_tokens(match) // bs, (len(token_ids) - 1) // bs
        if not self.enable_prefix_caching or first >= max_blocks:
            return match
        loads = self.offload.find(prefix_hash(token_ids, first, bs), token_ids, first, max_blocks)
        return Offloaded(match, first, loads) if loads else match

    def num_cached_tokens(self, cached) -> int:
        if isinstance(cached, Offloaded):
            return (cached.first + len(cached.loads)) * self.block_size
        return super().num_cached_tokens(cached)

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        return self.num_cached_tokens(self.find_cached_prefix("", token_ids))

    def can_allocate(self, seq_id: str, num_tokens: int, cached=()) -> bool:
        return super().can_allocate(seq_id, num_tokens, cached.match if isinstance(cached, Offloaded) else cached)

    def allocate(self, seq_id: str, num_tokens: int, cached=()) -> bool:
        if not isinstance(cached, Offloaded):
            return super().allocate(seq_id, num_tokens, cached)
        if not super().allocate(seq_id, num_tokens, cached.match):
            return False
        dests = self.block_tables[seq_id][cached.first:cached.first + len(cached.loads)]
        if self.pending_copies:  # the radix cache's copy of a partly matched block: the tier's whole one replaces it
            self.pending_copies = [(s, d) for s, d in self.pending_copies if d != dests[0]]
        self.offload.claim(cached.loads, dests)
        self._loaded_tokens = len(dests) * self.block_size
        return True

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Called by the scheduler right after the allocate that admitted the request: the pool's
        hits are what it found less what that allocate loads from the tiers (counted per tier)."""
        loaded, self._loaded_tokens = self._loaded_tokens, 0
        super().record_prefix_query(num_tokens, num_hit_tokens - loaded)
        self.offload.query_tokens += num_tokens - (num_hit_tokens - loaded)

    def _pop_free(self) -> int:
        # the hash cache evicts here: the block popleft takes next, if it still holds a cached hash
        b = self.free_queue.next[self.free_queue.end]
        h = self.block_hash[b] if b != self.free_queue.end else None
        if h is not None and self.cached.get(h) == b:
            self.offload.evicted(b, h)
        return super()._pop_free()

    def _evicting(self, leaf) -> None:
        """The radix cache drops `leaf`: its full blocks go to the tier under their chained hashes."""
        keys, node = [], leaf
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        tokens = [t for key in reversed(keys) for t in key]
        bs = self.block_size
        first = leaf.start // bs
        h, hashes = None, []
        for i in range(leaf.end // bs):
            h = hash_block(h, tuple(tokens[i * bs:(i + 1) * bs]))
            hashes.append(h)
        # a first block the leaf shares with its parent goes too: past the parent's end its slots
        # hold the leaf's tokens (a later request that parts there writes into a copy), and the
        # parent's node, which keeps the block, could not name that content by its own path
        for j, b in enumerate(leaf.blocks):
            if first + j < len(hashes):
                self.offload.evicted(b, hashes[first + j])

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.offload.reset()


class OffloadingBlockManager(OffloadingCache, BlockManager):
    """The hash prefix cache with a tier below it."""


class OffloadingRadixCache(OffloadingCache, RadixCache):
    """The radix prefix cache with a tier below it."""


def build_offload(pool, config, device) -> KVOffload:
    """The tiers below `pool`: config.kv_offloading_size GiB each (llmopt/worker/kv_tier.py's
    build_tiers; a disk tier's file in config.kv_offloading_path)."""
    nbytes = BlockBytes(pool).nbytes
    tiers = ([] if config.kv_offloading_size is None else  # none: only received prompts (kv_transfer_config)
             build_tiers(config.kv_offloading_size, nbytes, device, config.kv_offloading_path))
    return KVOffload(tiers, pool, config.block_size)


def prefix_cache_class(kind: str, offloading: bool) -> type:
    if offloading:
        return OffloadingRadixCache if kind == "radix" else OffloadingBlockManager
    return RadixCache if kind == "radix" else BlockManager


def move_blocks(engine, sched) -> None:
    """Before a step's forward: evicted blocks out to the tier, the radix cache's copies, then the
    tier's hits in; a request whose loaded block failed its check is preempted (it recomputes)."""
    bm = engine.block_manager
    offload = getattr(bm, "offload", None)
    if offload is not None:
        offload.store_evicted()  # first: a block just evicted may be a copy's or a load's target
    copies = bm.take_block_copies() if bm.pending_copies else []
    if copies:  # radix cache: hits that end inside a block get their slots before the forward
        engine.kv_cache.copy_blocks(copies)
        if engine.proposer is not None:
            engine.proposer.copy_blocks(copies)
    failed = offload.load_claimed() if offload is not None else ()
    if getattr(engine, "kv_connector", None) is not None and engine.kv_connector.open:
        for seq, _ in sched.scheduled:  # loaded: a received prompt's file is no longer needed
            engine.kv_connector.release(seq.request_id)
    for seq, _ in list(sched.scheduled) if failed else ():
        if failed.intersection(bm.block_tables.get(seq.request_id, ())):
            engine.scheduler.preempt(seq, sched)
