"""KV caches: what the attention layers keep between steps, behind one small interface.

The model's attention asks its cache one thing: `attend(layer, q, k, v)`: store the
keys and values of this step's new tokens, and attend the new queries over everything
the sequence has so far. How tokens are laid out in memory is the cache's business:

- `NoKVCache` keeps nothing, so every step must feed the whole sequence again
  (the naive loop: O(n^2) work to generate n tokens);
- `ContiguousKVCache` reserves one contiguous [max_len] strip per sequence, the way
  Hugging Face's static cache and pre-vLLM servers do; later the paged cache keeps
  the same interface and allocates fixed-size blocks on demand instead.

A step's batch is flattened: the new tokens of all sequences one after another, as
vLLM lays them out; `begin_step` tells the cache which sequence owns which tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.kernels.paged_attention import paged_attention, write_kv
from llmopt.layers.attention import batched_decode_attention, sequence_attention


@dataclass
class StepLayout:
    """Which sequences are in this step, and how many new tokens each brings."""

    slots: list[int]          # cache slot of each sequence
    query_lens: list[int]     # new tokens per sequence (flattened in this order)
    context_lens: list[int]   # tokens each sequence had cached before this step

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class KVCache:
    """The interface the model sees."""

    layout: StepLayout

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, window: int | None = None) -> torch.Tensor:
        raise NotImplementedError


class NoKVCache(KVCache):
    """Remembers nothing: each forward holds complete sequences (query_lens = lengths)."""

    def begin_step(self, query_lens: list[int]) -> None:
        self.layout = StepLayout(list(range(len(query_lens))), list(query_lens), [0] * len(query_lens))

    def attend(self, layer, q, k, v, scale, window=None):
        outs, start = [], 0
        for n in self.layout.query_lens:
            end = start + n
            outs.append(sequence_attention(q[start:end], k[start:end], v[start:end], scale, window))
            start = end
        return torch.cat(outs)


class ContiguousKVCache(KVCache):
    """One preallocated [num_kv_heads, max_len, head_dim] strip per sequence slot and layer.

    Memory is reserved for `max_len` tokens whether a sequence uses 10 or 2,000 of them:
    simple and fast to index, and exactly the waste PagedAttention removes.
    """

    def __init__(self, num_layers: int, max_seqs: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu"):
        shape = (max_seqs, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.lens = [0] * max_seqs          # tokens cached per slot
        self.free_slots = list(range(max_seqs - 1, -1, -1))

    # -- slots -----------------------------------------------------------------------
    def allocate(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free KV cache slot")
        slot = self.free_slots.pop()
        self.lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lens[slot] = 0
        self.free_slots.append(slot)

    # -- one step ----------------------------------------------------------------------
    def begin_step(self, slots: list[int], query_lens: list[int]) -> None:
        context = [self.lens[s] for s in slots]
        for s, c, n in zip(slots, context, query_lens):
            if c + n > self.max_len:
                raise RuntimeError(f"slot {s} would hold {c + n} tokens; it has room for {self.max_len}")
            self.lens[s] = c + n
        self.layout = StepLayout(list(slots), list(query_lens), context)
        self._decode_index = torch.tensor(slots, device=self.k[0].device)
        self._decode_lens = torch.tensor(self.layout.seq_lens, device=self.k[0].device)

    def attend(self, layer, q, k, v, scale, window=None):
        K, V, lay = self.k[layer], self.v[layer], self.layout
        if lay.is_decode:
            # Every sequence brings one token: write them all, attend in one batched call.
            idx, pos = self._decode_index, self._decode_lens - 1
            K[idx, :, pos] = k
            V[idx, :, pos] = v
            Lmax = max(lay.seq_lens)
            return batched_decode_attention(q, K[idx, :, :Lmax], V[idx, :, :Lmax],
                                            self._decode_lens, scale, window)
        outs, start = [], 0
        for slot, c, n in zip(lay.slots, lay.context_lens, lay.query_lens):
            end = start + n
            K[slot, :, c:c + n] = k[start:end].transpose(0, 1)
            V[slot, :, c:c + n] = v[start:end].transpose(0, 1)
            outs.append(sequence_attention(q[start:end], K[slot, :, :c + n].transpose(0, 1),
                                           V[slot, :, :c + n].transpose(0, 1), scale, window))
            start = end
        return torch.cat(outs)

    # -- memory accounting (lesson 01 and 02 read these) -------------------------------------
    @property
    def bytes_reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_used(self) -> int:
        per_token = self.bytes_reserved // (len(self.lens) * self.max_len)
        return sum(self.lens) * per_token


@dataclass
class PagedBatch:
    """The flat step layout for paged attention (vLLM's attention metadata)."""

    query_lens: list[int]
    context_lens: list[int]           # tokens already cached before this step
    block_tables: list[list[int]]     # per sequence, its blocks in order
    slot_mapping: torch.Tensor        # [num_tokens] block * block_size + offset of each new token
    block_table_tensor: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor     # [num_seqs + 1] int32
    seq_lens_tensor: torch.Tensor     # [num_seqs] int32

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]


class PagedKVCache(KVCache):
    """Per layer, a pool of blocks `[num_blocks, block_size, num_kv_heads, head_dim]` for K and V.

    Each step first writes the new tokens' keys and values into their slots (the
    `slot_mapping`), then attends every query over its sequence's blocks, found through
    the block table. On CUDA the Triton kernels in `llmopt.kernels.paged_attention` do
    this; on CPU a torch path does (one batched call for decodes, one call per prefill).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu"):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: the torch path multiplies masked-out (padding) slots by a zero
        # attention weight, and 0 x NaN from uninitialized memory would still be NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        # the Triton kernels cover the head sizes real models use; anything else stays on torch
        self.use_triton = torch.device(device).type == "cuda" and head_dim in (16, 32, 64, 128)

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # Decodes are attended in groups of similar length: the torch path pads each group
    # to its longest context, so sorting by length first keeps the padding small.
    DECODE_GROUP = 16

    def begin_step(self, batch: PagedBatch) -> None:
        self.batch = batch
        if self.use_triton:  # the kernels read the block tables directly
            return
        decode = sorted((i for i, n in enumerate(batch.query_lens) if n == 1),
                        key=lambda i: batch.seq_lens[i])
        self._decode_rows = decode
        self._decode_groups = []
        dev = self.k[0].device
        starts = batch.query_start_loc[:-1].long()
        for g in range(0, len(decode), self.DECODE_GROUP):
            rows = decode[g:g + self.DECODE_GROUP]
            index = torch.tensor(rows, device=dev)
            nb = -(-batch.seq_lens[rows[-1]] // self.block_size)  # rows are sorted by length
            self._decode_groups.append((
                starts[index],                                  # each query's row in the flat batch
                batch.seq_lens_tensor.long()[index],            # valid keys per sequence
                batch.block_table_tensor[index, :nb].long()))   # their blocks, padded to the group
        # Prompts and prompt chunks: where their queries sit, and (after cached context) which
        # blocks hold their keys. Worked out once per step, not once per layer.
        self._prefills = []
        start = 0
        for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if n > 1:
                blocks = None
                if ctx:
                    nb = -(-(ctx + n) // self.block_size)
                    blocks = torch.tensor(batch.block_tables[i][:nb], device=dev)
                self._prefills.append((start, start + n, ctx, blocks))
            start += n

    def attend(self, layer, q, k, v, scale, window=None):
        K, V, b = self.k[layer], self.v[layer], self.batch
        write_kv(k, v, K, V, b.slot_mapping)
        if self.use_triton:
            return paged_attention(q, K, V, b.block_table_tensor, b.query_start_loc, b.seq_lens_tensor,
                                   scale, window, max_query_len=max(b.query_lens))
        return self._attend_torch(q, k, v, K, V, scale, window)

    def _attend_torch(self, q, k, v, K, V, scale, window):
        out = torch.empty_like(q)
        for tokens, lens, tables in self._decode_groups:
            # gather each group's blocks into a padded [B, Hkv, L, D] batch; index_select on the
            # flattened table is the fastest gather torch has on CPU
            B, nb = tables.shape
            flat = tables.flatten()
            kg = K.index_select(0, flat).view(B, nb * self.block_size, *K.shape[2:]).transpose(1, 2)
            vg = V.index_select(0, flat).view(B, nb * self.block_size, *V.shape[2:]).transpose(1, 2)
            out[tokens] = batched_decode_attention(q[tokens], kg, vg, lens, scale, window)
        for s, e, ctx, blocks in self._prefills:
            if blocks is None:  # a whole prompt: its keys are exactly this step's keys
                keys, values = k[s:e], v[s:e]
            else:               # a chunk after cached context: read the context from the blocks
                keys = K[blocks].flatten(0, 1)[:ctx + e - s]
                values = V[blocks].flatten(0, 1)[:ctx + e - s]
            out[s:e] = sequence_attention(q[s:e], keys, values, scale, window)
        return out
