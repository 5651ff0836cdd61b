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

The paged cache can also store its blocks in FP8 (`kv_cache_dtype="fp8"`): one byte per
number instead of two (bf16) or four (fp32), so the same memory holds 2x (or 4x) the
tokens. Each layer then keeps a per-tensor `k_scale` and `v_scale`: the pool holds
fp8(clamp(k / k_scale)) and attention reads fp8 * k_scale. The scales come from the
checkpoint (as llm-compressor and vLLM name them), from calibration (the largest |k| and
|v| over calibration text, mapped onto the format's largest value), or are 1.0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmopt.fp8 import KV_CACHE_FP8_DTYPES, is_fp8, scale_from_amax
from llmopt.kernels.mla_attention import latent_attention
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

    def attend_latent(self, layer: int, q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int,
                      scale: float) -> torch.Tensor:
        """MLA's attention over cached latent rows (llmopt/layers/mla.py)."""
        raise TypeError(f"{type(self).__name__} keeps keys and values per head; an MLA model (DeepSeek) "
                        "needs a latent cache: the paged engine's MLAPagedKVCache, or NoKVCache")


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

    def attend_latent(self, layer, q, kv, kv_lora_rank, scale):
        """MLA (llmopt/layers/mla.py): attention over each sequence's cached latent rows."""
        outs, start = [], 0
        for n in self.layout.query_lens:
            outs.append(latent_attention(q[start:start + n], kv[start:start + n], kv_lora_rank, scale))
            start += n
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


def kv_cache_torch_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """vLLM's kv_cache_dtype names -> the pool's torch dtype ("auto": the model's dtype)."""
    if is_fp8(model_dtype):
        raise ValueError(f"the model's dtype cannot be {model_dtype}: attention computes in "
                         "float32/float16/bfloat16; put FP8 in the cache with kv_cache_dtype='fp8'")
    if kv_cache_dtype == "auto":
        return model_dtype
    if isinstance(kv_cache_dtype, torch.dtype) and (is_fp8(kv_cache_dtype) or kv_cache_dtype == model_dtype):
        return kv_cache_dtype
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_FP8_DTYPES:
        return KV_CACHE_FP8_DTYPES[kv_cache_dtype]
    raise ValueError(f"kv_cache_dtype must be 'auto', {', '.join(map(repr, KV_CACHE_FP8_DTYPES))}, "
                     f"got {kv_cache_dtype!r}")


class PagedKVCache(KVCache):
    """Per layer, a pool of blocks `[num_blocks, block_size, num_kv_heads, head_dim]` for K and V.

    Each step first writes the new tokens' keys and values into their slots (the
    `slot_mapping`), then attends every query over its sequence's blocks, found through
    the block table. On CUDA the Triton kernels in `llmopt.kernels.paged_attention` do
    this; on CPU a torch path does (one batched call for decodes, one call per prefill).
    With an FP8 pool both read fp8 * scale; attention itself runs in the model's dtype.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 kv_cache_dtype: str | torch.dtype = "auto"):
        self.dtype = dtype                                              # attention's dtype
        self.cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)  # the pool's dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Empty, not zeros: nothing ever reads a slot before its token's key and value are
        # written there (the torch path gathers only written slots, the kernels mask the rest),
        # so a slot's old contents, even a NaN a failed request left behind, never reach
        # another request; and a CPU pool of gigabytes costs memory only as it fills.
        self.k = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        # Per layer, one scale for all keys and one for all values (1.0: stored as is).
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.scale_source = "unit"  # or "checkpoint", "calibrated", "set"
        # the Triton kernels cover the head sizes real models use; anything else stays on torch
        self.use_triton = torch.device(device).type == "cuda" and head_dim in (16, 32, 64, 128)

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.cache_dtype)

    # -- FP8 scales ----------------------------------------------------------------------------
    def set_scales(self, k_scale: list[float], v_scale: list[float], source: str = "set") -> None:
        """Per-layer scales for an FP8 pool (set them before anything is cached: blocks
        already written were divided by the old ones)."""
        if not self.is_fp8:
            raise ValueError(f"k/v scales apply to an FP8 KV cache; this one stores {self.cache_dtype} "
                             "(create the LLM with kv_cache_dtype='fp8')")
        n = len(self.k)
        for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
            if len(scales) != n:
                raise ValueError(f"{name}: expected {n} scales (one per layer), got {len(scales)}")
            bad = [s for s in map(float, scales) if not (0 < s < float("inf"))]
            if bad:
                raise ValueError(f"{name} must be positive finite numbers, got {bad[:3]}")
        self.k_scale, self.v_scale = [float(s) for s in k_scale], [float(s) for s in v_scale]
        self.scale_source = source

    def calibrate(self, model, token_ids: list[list[int]]) -> None:
        """Scales from amax: run calibration sequences through the model (no cache), keep
        each layer's largest |key| and |value|, map them onto the format's largest value."""
        k_amax, v_amax = observe_kv_amax(model, token_ids, len(self.k))
        self.set_scales([scale_from_amax(a, self.cache_dtype).item() for a in k_amax],
                        [scale_from_amax(a, self.cache_dtype).item() for a in v_amax], "calibrated")

    def load_scales(self, folder: str | Path) -> bool:
        """The checkpoint's k/v scales, if it has them (True when found)."""
        scales = read_kv_scales(folder, len(self.k))
        if scales is not None:
            self.set_scales(*scales, source="checkpoint")
        return scales is not None

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
        num_kv_heads = self.k[0].shape[2]
        for g in range(0, len(decode), self.DECODE_GROUP):
            rows = decode[g:g + self.DECODE_GROUP]
            index = torch.tensor(rows, device=dev)
            lens = batch.seq_lens_tensor.long()[index]
            L = batch.seq_lens[rows[-1]]  # rows are sorted by length: the group's longest
            tables = batch.block_table_tensor[index, :-(-L // self.block_size)].long()
            # Each sequence's slots for positions 0..L-1; positions past its own length (the
            # group's padding) re-read its position 0, a written slot, and are masked out.
            pos = torch.arange(L, device=dev)
            valid = pos[None, :] < lens[:, None]
            slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
            slots = torch.where(valid, slots, slots[:, :1])
            # The pool viewed as rows of head_dim numbers, ordered (sequence, kv head, position):
            # one gather gives each group a contiguous [B, Hkv, L, D], and it is worked out once
            # per step for every layer, as is the additive mask.
            heads = torch.arange(num_kv_heads, device=dev)
            gather = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
            mask = torch.zeros(len(rows), 1, 1, L, dtype=self.dtype, device=dev).masked_fill_(
                ~valid[:, None, None, :], float("-inf"))
            self._decode_groups.append((starts[index], gather, mask, lens, L))
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
        ks, vs = self.k_scale[layer], self.v_scale[layer]
        write_kv(k, v, K, V, b.slot_mapping, ks, vs)
        if self.use_triton:
            return paged_attention(q, K, V, b.block_table_tensor, b.query_start_loc, b.seq_lens_tensor,
                                   scale, window, max_query_len=max(b.query_lens), k_scale=ks, v_scale=vs)
        return self._attend_torch(q, k, v, K, V, ks, vs, scale, window)

    def _read(self, pool: torch.Tensor, index: torch.Tensor, scale: float) -> torch.Tensor:
        """pool[index] along dim 0, in the model's dtype: as stored, or fp8 * scale."""
        if not self.is_fp8:
            return pool.index_select(0, index)
        # gather the bytes (every device gathers uint8; not every one gathers float8), then widen
        raw = pool.view(torch.uint8).index_select(0, index).view(pool.dtype)
        return (raw.float() * scale).to(self.dtype)

    def _attend_torch(self, q, k, v, K, V, k_scale, v_scale, scale, window):
        out = torch.empty_like(q)
        num_kv_heads, head_dim = K.shape[2], K.shape[3]
        for tokens, gather, mask, lens, L in self._decode_groups:
            # gather each group's keys and values into a padded [B, Hkv, L, D] batch
            # (index_select is the fastest gather torch has on CPU), then one SDPA call
            B = tokens.shape[0]
            kg = self._read(K.view(-1, head_dim), gather, k_scale).view(B, num_kv_heads, L, head_dim)
            vg = self._read(V.view(-1, head_dim), gather, v_scale).view(B, num_kv_heads, L, head_dim)
            if window is not None:  # sliding window: only the last `window` keys of each sequence
                pos = torch.arange(L, device=q.device)
                mask = mask.masked_fill((pos[None, :] < lens[:, None] - window)[:, None, None, :],
                                        float("-inf"))
            out[tokens] = F.scaled_dot_product_attention(q[tokens].unsqueeze(2), kg, vg, attn_mask=mask,
                                                         scale=scale, enable_gqa=True).squeeze(2)
        for s, e, ctx, blocks in self._prefills:
            if blocks is None and not self.is_fp8:  # a whole prompt: its keys are this step's keys
                keys, values = k[s:e], v[s:e]
            elif blocks is None:  # ... as the FP8 pool holds them, so chunked == unchunked
                slots = self.batch.slot_mapping[s:e].long()
                keys = self._read(K.view(-1, *K.shape[2:]), slots, k_scale)
                values = self._read(V.view(-1, *V.shape[2:]), slots, v_scale)
            else:                 # a chunk after cached context: read the context from the blocks
                keys = self._read(K, blocks, k_scale).flatten(0, 1)[:ctx + e - s]
                values = self._read(V, blocks, v_scale).flatten(0, 1)[:ctx + e - s]
            out[s:e] = sequence_attention(q[s:e], keys, values, scale, window)
        return out


# -- where FP8 scales come from ------------------------------------------------------------------

class KVAmaxObserver(NoKVCache):
    """Attends like `NoKVCache` and records, per layer, the largest |key| and |value| it saw
    (keys after RoPE: what the cache stores). The statistic FP8 KV scales are made from."""

    def __init__(self, num_layers: int):
        self.k_amax = [0.0] * num_layers
        self.v_amax = [0.0] * num_layers

    def attend(self, layer, q, k, v, scale, window=None):
        self.k_amax[layer] = max(self.k_amax[layer], k.abs().max().item())
        self.v_amax[layer] = max(self.v_amax[layer], v.abs().max().item())
        return super().attend(layer, q, k, v, scale, window)


@torch.inference_mode()
def observe_kv_amax(model, token_ids: list[list[int]], num_layers: int) -> tuple[list[float], list[float]]:
    """Run sequences (one flat batch) through `model` and return per-layer (k_amax, v_amax)."""
    if not token_ids or not all(token_ids):
        raise ValueError("calibration needs at least one non-empty sequence of token ids")
    device = next(model.parameters()).device
    observer = KVAmaxObserver(num_layers)
    observer.begin_step([len(t) for t in token_ids])
    ids = torch.tensor([t for seq in token_ids for t in seq], device=device)
    positions = torch.cat([torch.arange(len(t), device=device) for t in token_ids])
    model(ids, positions, observer)
    return observer.k_amax, observer.v_amax


def calibration_token_ids(tokenizer, num_tokens: int = 4096, seq_len: int = 512) -> list[list[int]]:
    """`num_tokens` tokens of the bundled held-out text's calibration part (never the part
    that evaluation scores), cut into sequences of `seq_len`."""
    from llmopt.eval import heldout_text

    ids = tokenizer(heldout_text("calibration"), add_special_tokens=False,
                    verbose=False)["input_ids"][:num_tokens]
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]


# Checkpoint names for per-layer KV scales, as vLLM reads them: llm-compressor's
# `self_attn.k_scale` (older: `k_proj.output_scale`), ModelOpt's `k_proj.k_scale`, and the
# deprecated single `kv_scale` (used for both).
_KV_SCALE_NAME = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_scale|(k|v)_proj\.(?:output_scale|(?:k|v)_scale)|(kv)_scale)$")


def read_kv_scales(folder: str | Path, num_layers: int) -> tuple[list[float], list[float]] | None:
    """Per-layer (k_scales, v_scales) from a checkpoint's safetensors, or None if it has none.

    ValueError if only some layers have them, or a scale is not a positive finite number.
    """
    from safetensors import safe_open

    from llmopt.model.gguf import is_gguf
    from llmopt.model.loader import safetensors_files

    if is_gguf(folder):
        return None  # llama.cpp's format stores no KV-cache scales
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for f in safetensors_files(Path(folder)):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                m = _KV_SCALE_NAME.search(name)
                if m is None:
                    continue
                layer, which = int(m.group(1)), m.group(2) or m.group(3) or m.group(4)
                t = handle.get_tensor(name).float()
                if t.numel() != 1:
                    raise ValueError(f"{f}: {name} has shape {tuple(t.shape)}; a per-tensor KV scale "
                                     "has one element")
                value = t.item()
                if not (0 < value < float("inf")):
                    raise ValueError(f"{f}: {name} = {value}; a KV scale must be a positive finite number")
                for kv in ("k", "v") if which == "kv" else (which,):
                    found[kv].setdefault(layer, value)
    if not found["k"] and not found["v"]:
        return None
    for kv in ("k", "v"):
        missing = sorted(set(range(num_layers)) - set(found[kv]))
        if missing:
            raise ValueError(f"{folder}: the checkpoint has KV scales, but no {kv}_scale for layers "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return [found["k"][i] for i in range(num_layers)], [found["v"][i] for i in range(num_layers)]
