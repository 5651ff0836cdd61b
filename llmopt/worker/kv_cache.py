"""KV caches: where a model's keys and values stay between steps. They store; attention attends.

The model's attention layers (llmopt.layers.attention) hand their cache each step's new keys
and values (`store`), then read them back, however the cache lays them out:

- `NoKVCache` keeps nothing, so every step must feed the whole sequence again
  (the naive loop: O(n^2) work to generate n tokens);
- `ContiguousKVCache` reserves one contiguous [max_len] strip per sequence, the way
  Hugging Face's static cache and pre-vLLM servers do;
- `PagedKVCache` allocates fixed-size blocks on demand (PagedAttention): a token's slot is
  block * block_size + offset, found through its sequence's block table.

A step's batch is flattened: the new tokens of all sequences one after another, as vLLM
lays them out; the step's `AttentionMetadata`, which says which sequence owns which tokens
and where they go, is handed to every `store` (and `begin_step(meta)` lets a cache account
for the step first).

The paged cache can also store its blocks in FP8 (`kv_cache_dtype="fp8"`): one byte per
number instead of two (bf16) or four (fp32), so the same memory holds 2x (or 4x) the
tokens. Each layer then keeps a per-tensor `k_scale` and `v_scale`: the pool holds
fp8(clamp(k / k_scale)) and attention reads fp8 * k_scale. The scales come from the
checkpoint (as llm-compressor and vLLM name them), from calibration (the largest |k| and
|v| over calibration text, mapped onto the format's largest value; per layer or per KV head),
or are 1.0. `rotate()` makes the pool hold keys and values turned by a Hadamard matrix
(queries turn alike, so attention is unchanged), which spreads a key's few large channels
over all of them before FP8 rounds them.

Below 8 bits (`kv_cache_dtype="int8"` or `"int4"`): the pool holds integer codes, keys grouped
per block and channel and values per token and 32 or 64 channels (KIVI's grouping; the format,
the write and the read are llmopt/kernels/int_kv_ref.py), the groups' scales (and int4's minimums)
in `k_scales` / `v_scales` beside the codes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.fp8.format import FP8_DTYPES, KV_CACHE_FP8_DTYPES, is_fp8, quantize_fp8, scale_from_amax
from llmopt.fp8.kv_scales import read_kv_scales
from llmopt.kernels.int_kv_ref import INT_KV_DTYPES, bytes_per_token, code_width, int_kv_bits, scale_shapes, write_int_kv
from llmopt.layers.attention import AttentionMetadata, KVCache, contiguous_attention
from llmopt.layers.paged_attention import PAGED_ATTENTION, pick_paged_attention
from llmopt.model.forward import run_model


class NoKVCache(KVCache):
    """Remembers nothing: each forward holds complete sequences (query_lens = lengths)."""

    def begin_step(self, meta: AttentionMetadata) -> None:
        if any(meta.context_lens):
            raise ValueError("a NoKVCache step holds whole sequences: context_lens must be 0 "
                             "(use AttentionMetadata.uncached)")

    def store_latent(self, layer: int, kv: torch.Tensor, meta: AttentionMetadata) -> None:
        """MLA's latent rows (llmopt/layers/mla.py): kept nowhere either."""


class ContiguousKVCache(KVCache):
    """One preallocated [num_kv_heads, max_len, head_dim] strip per sequence slot and layer.

    Memory is reserved for `max_len` tokens whether a sequence uses 10 or 2,000 of them:
    simple and fast to index, and exactly the waste PagedAttention removes.
    """

    layout = "contiguous"
    attend = staticmethod(contiguous_attention)

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
    def begin_step(self, meta: AttentionMetadata) -> None:
        for s, c, n in zip(meta.slots, meta.context_lens, meta.query_lens):
            if c != self.lens[s]:
                raise RuntimeError(f"slot {s} holds {self.lens[s]} tokens; the step says {c}")
            if c + n > self.max_len:
                raise RuntimeError(f"slot {s} would hold {c + n} tokens; it has room for {self.max_len}")
            self.lens[s] = c + n
        if meta.is_decode:  # every layer's store writes one token per strip at these indices
            meta.plans["contiguous"] = (torch.tensor(meta.slots, device=self.k[0].device),
                                        torch.tensor(meta.context_lens, device=self.k[0].device))

    def store(self, layer, k, v, meta):
        K, V = self.k[layer], self.v[layer]
        if meta.is_decode:  # one token per sequence: one indexed write for all of them
            index, pos = meta.plans["contiguous"]
            K[index, :, pos] = k
            V[index, :, pos] = v
            return
        start = 0
        for slot, c, n in zip(meta.slots, meta.context_lens, meta.query_lens):
            K[slot, :, c:c + n] = k[start:start + n].transpose(0, 1)
            V[slot, :, c:c + n] = v[start:start + n].transpose(0, 1)
            start += n

    # -- memory accounting (lesson 01 and 02 read these) -------------------------------------
    @property
    def bytes_reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_used(self) -> int:
        per_token = self.bytes_reserved // (len(self.lens) * self.max_len)
        return sum(self.lens) * per_token


def kv_cache_torch_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """vLLM's kv_cache_dtype names -> the pool's torch dtype ("auto": the model's dtype)."""
    if is_fp8(model_dtype):
        raise ValueError(f"the model's dtype cannot be {model_dtype}: attention computes in "
                         "float32/float16/bfloat16; put FP8 in the cache with kv_cache_dtype='fp8'")
    if kv_cache_dtype == "auto":
        return model_dtype
    # "bfloat16": half the bytes of a float32 model's KV (llama.cpp keeps its KV in 16 bits by
    # default); attention reads the rows and widens them to float32, exactly (bf16 is float32's top half)
    if kv_cache_dtype in ("bfloat16", torch.bfloat16):
        return torch.bfloat16
    if isinstance(kv_cache_dtype, torch.dtype) and (is_fp8(kv_cache_dtype) or kv_cache_dtype == model_dtype):
        return kv_cache_dtype
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_FP8_DTYPES:
        return KV_CACHE_FP8_DTYPES[kv_cache_dtype]
    # int8: int8 codes; int4: two codes a uint8 byte (llmopt/kernels/int_kv_ref.py)
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in INT_KV_DTYPES:
        return INT_KV_DTYPES[kv_cache_dtype]
    if kv_cache_dtype in INT_KV_DTYPES.values():
        return kv_cache_dtype
    raise ValueError(f"kv_cache_dtype must be 'auto', 'bfloat16', {', '.join(map(repr, KV_CACHE_FP8_DTYPES))}, "
                     f"'int8' or 'int4', got {kv_cache_dtype!r}")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """Store new tokens' keys and values in a paged pool, before attention reads them.

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping[t] = block * block_size + offset.
    Viewing the pool as one long row of slots turns the write into a plain index_copy_.
    An fp8 pool stores fp8(clamp(k / k_scale)) and fp8(clamp(v / v_scale)) (the clamp: past the
    largest finite value a cast gives inf (e5m2) or NaN (e4m3, where it does not saturate))."""
    slots = slot_mapping.long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype in FP8_DTYPES:  # copy bytes: index_copy_ has no float8 version on every device
            x, cache = quantize_fp8(x, scale, cache.dtype).view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))


class PagedKVCache(KVCache):
    """Per layer, a pool of blocks `[num_blocks, block_size, num_kv_heads, head_dim]` for K and V.

    `store` writes each new token's key and value into its slot (the step's `slot_mapping`);
    attention then reads every key, its own included, from the pool through the block table.
    With an FP8 pool the pool holds fp8(k / k_scale); attention itself runs in the model's dtype.
    """

    layout = "paged"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 kv_cache_dtype: str | torch.dtype = "auto", kernels: bool = True):
        self.dtype = dtype                                              # attention's dtype
        self.cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)  # the pool's dtype
        self.int_bits = int_kv_bits(self.cache_dtype)  # 8 or 4 for an int pool, else None
        width = head_dim if self.int_bits is None else code_width(head_dim, self.int_bits)
        shape = (num_blocks, block_size, num_kv_heads, width)
        # Empty, not zeros: nothing ever reads a slot before its token's key and value are
        # written there (the torch path gathers only written slots, the kernels mask the rest),
        # so a slot's old contents, even a NaN a failed request left behind, never reach
        # another request; and a CPU pool of gigabytes costs memory only as it fills.
        self.k = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=self.cache_dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size, self.head_dim = num_blocks, block_size, head_dim
        # an int pool's groups: keys per block and channel, values per slot and group of channels
        self.k_scales = self.v_scales = None
        if self.int_bits is not None:
            (ks, kd), (vs, vd) = scale_shapes(num_blocks, block_size, num_kv_heads, head_dim, self.int_bits)
            self.k_scales = [torch.zeros(ks, dtype=kd, device=device) for _ in range(num_layers)]
            self.v_scales = [torch.zeros(vs, dtype=vd, device=device) for _ in range(num_layers)]
        # Per layer, one scale for all keys and one for all values (1.0: stored as is).
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.scale_source = "unit"  # or "checkpoint", "calibrated", "set"
        # Per layer, an optional [Hkv, D] vector subtracted from every key before it is stored
        # (SageAttention's smoothing): q.(k - c) = q.k - q.c shifts all of one query's scores by the
        # same amount, which softmax ignores, so attention is unchanged while a channel's constant
        # offset no longer eats FP8's relative precision.
        self.k_shift: list[torch.Tensor] | None = None
        # how attention reads the pool, fixed here: the C++ kernel (CPU) or Triton (CUDA) where they
        # run these dtypes and head sizes, else the torch path; kernels=False (enforce_eager): torch
        self.use_attention(pick_paged_attention(device, dtype, self.cache_dtype, head_dim, kernels))

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.cache_dtype)

    def use_attention(self, name: str) -> None:
        """Read the pool with paged attention `name`: "torch", "cpu" (the C++ kernel) or "triton"."""
        if name not in PAGED_ATTENTION:
            raise ValueError(f"paged attention {name!r}: allowed {', '.join(map(repr, PAGED_ATTENTION))}")
        self.attention, self.attend = name, PAGED_ATTENTION[name]

    def store(self, layer, k, v, meta):
        if self.int_bits is not None:
            write_int_kv(k, v, self.k[layer], self.v[layer], self.k_scales[layer], self.v_scales[layer],
                         meta.slot_mapping, self.int_bits)
            return
        if self.k_shift is not None:  # smoothed keys: what the pool holds is k - shift
            k = k - self.k_shift[layer].to(k.dtype)
        write_kv(k, v, self.k[layer], self.v[layer], meta.slot_mapping,
                 self.k_scale[layer], self.v_scale[layer])

    # -- FP8 scales ----------------------------------------------------------------------------
    def set_scales(self, k_scale: list, v_scale: list, source: str = "set") -> None:
        """Per-layer scales for an FP8 pool (set them before anything is cached: blocks
        already written were divided by the old ones). Each layer's scale is a number, or one
        per KV head (a sequence of num_kv_heads numbers: llm-compressor's "attn_head" strategy)."""
        if not self.is_fp8:
            raise ValueError(f"k/v scales apply to an FP8 KV cache; this one stores {self.cache_dtype} "
                             "(create the LLM with kv_cache_dtype='fp8')")
        n, heads = len(self.k), self.k[0].shape[2]
        for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
            if len(scales) != n:
                raise ValueError(f"{name}: expected {n} scales (one per layer), got {len(scales)}")
            flat = [float(x) for s in scales for x in (torch.as_tensor(s).reshape(-1).tolist())]
            bad = [s for s in flat if not (0 < s < float("inf"))]
            if bad:
                raise ValueError(f"{name} must be positive finite numbers, got {bad[:3]}")
            if any(torch.as_tensor(s).numel() not in (1, heads, heads * self.k[0].shape[3]) for s in scales):
                raise ValueError(f"{name}: each layer's scale is one number, {heads} (one per KV head) or "
                                 f"{heads} x {self.k[0].shape[3]} (one per head and channel)")
        self.k_scale, self.v_scale = [_kv_scale(s, heads, self.k[0].device) for s in k_scale], \
            [_kv_scale(s, heads, self.k[0].device) for s in v_scale]
        if any(isinstance(s, torch.Tensor) for s in self.k_scale + self.v_scale):
            self.use_attention("torch")   # the kernels take one scale per layer; the torch path broadcasts
        self.scale_source = source

    def rotate(self, seed: int = 0) -> None:
        """Keep keys and values turned by one randomized Hadamard matrix R of order head_dim
        (QuaRot's online KV rotation): attention then hands the pool k R and v R, turns its
        queries by R and its output back by R^T, so it computes what it did (llmopt.layers.attention).
        What R buys is in the rounding: e4m3's error on a number is proportional to its size,
        so a score's error is carried by the channels where queries and keys are both large,
        and R spreads those over all head_dim channels (`benchmarks/precision.py --diagnose-kv`
        measures the overlap). Call it before anything is cached (and
        before calibrating: the scales are of rotated keys). Where a step runs compiled the
        compiled step declines a rotated pool (it has no rotation in it), so it decodes eagerly."""
        from llmopt.layers.hadamard import random_hadamard

        self.rotation = random_hadamard(self.head_dim, seed).to(torch.float32).to(self.k[0].device)

    def calibrate(self, model, token_ids: list[list[int]], per_head: bool = False,
                  smooth_keys: bool = False, per_channel: bool = False, rotate: bool = False) -> None:
        """Scales from amax: run calibration sequences through the model (no cache), keep
        each layer's (or each KV head's) largest |key| and |value|, map them onto the format's
        largest value; per_channel: one amax per KV head and channel ([Hkv, D], KIVI's
        granularity for keys). smooth_keys: first measure each layer's mean key per head and channel,
        store keys minus it (`k_shift`), and take the keys' amax after that shift. rotate: turn
        keys and values by a Hadamard matrix first (`rotate`), and measure the rotated ones."""
        if rotate:
            self.rotate()
        if smooth_keys:
            observer = observe_kv(model, token_ids, len(self.k), rotation=self.rotation)
            self.k_shift = [(s / observer.count).to(self.k[0].device) for s in observer.k_sum]
        k_amax, v_amax = observe_kv_amax(model, token_ids, len(self.k), "channel" if per_channel else per_head,
                                         self.k_shift, rotation=self.rotation)
        self.set_scales([scale_from_amax(a, self.cache_dtype) for a in k_amax],
                        [scale_from_amax(a, self.cache_dtype) for a in v_amax],
                        ("calibrated per channel" if per_channel else
                         "calibrated per head" if per_head else "calibrated") + (", rotated" if rotate else ""))

    def load_scales(self, folder: str | Path) -> bool:
        """The checkpoint's k/v scales, if it has them (True when found)."""
        scales = read_kv_scales(folder, len(self.k))
        if scales is not None:
            self.set_scales(*scales, source="checkpoint")
        return scales is not None

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        bits = int_kv_bits(dtype)
        if bits is not None:  # codes, the keys' groups per block and channel, the values' per slot
            return round(num_layers * block_size * bytes_per_token(num_kv_heads, head_dim, bits, block_size))
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst takes block src's keys and values, every layer (the radix prefix cache's
        copy-on-write of a partly matched block). Stored bytes are copied, FP8 ones too."""
        src = torch.tensor([s for s, _ in pairs], device=self.k[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.k[0].device)
        for pool in self.k + self.v + (self.k_scales or []) + (self.v_scales or []):
            pool[dst] = pool[src]


def _kv_scale(s, heads: int, device):
    """One layer's scale as the write and read helpers take it: a float, [Hkv, 1] per head or
    [Hkv, D] per head and channel."""
    t = torch.as_tensor(s, dtype=torch.float32)
    return float(t) if t.numel() == 1 else t.reshape(heads, -1).to(device)


# -- where FP8 scales come from ------------------------------------------------------------------

class KVAmaxObserver(NoKVCache):
    """Keeps nothing, like `NoKVCache`, but records per layer the largest |key| and |value| it
    is handed (keys after RoPE: what a cache stores). The statistic FP8 KV scales are made from.
    per_head: one amax per KV head ([Hkv]); "channel": per head and channel ([Hkv, D]). It also
    sums the keys (their mean is the smoothing shift) and keeps the keys' amax after k_shift."""

    def __init__(self, num_layers: int, per_head: bool | str = False, k_shift: list | None = None):
        self.k_amax = [0.0] * num_layers
        self.v_amax = [0.0] * num_layers
        self.per_head, self.k_shift = per_head, k_shift
        self.k_sum: list = [0.0] * num_layers   # for the mean key (smoothing)
        self.count = 0

    def store(self, layer, k, v, meta):
        self.k_sum[layer] = self.k_sum[layer] + k.float().sum(0)
        if layer == 0:
            self.count += k.shape[0]  # tokens seen, over every run through this observer
        stored = k if self.k_shift is None else k - self.k_shift[layer].to(k.dtype)
        # k, v: [tokens, Hkv, D]; per head: the amax over tokens and dims of each head;
        # "channel": [Hkv, D], the amax over tokens only
        dims = (0,) if self.per_head == "channel" else (0, 2)
        amax = (lambda x: x.abs().amax(dims).float()) if self.per_head else (lambda x: x.abs().max().item())
        for seen, x in ((self.k_amax, stored), (self.v_amax, v)):
            seen[layer] = torch.maximum(torch.as_tensor(seen[layer]), amax(x)) if self.per_head \
                else max(seen[layer], amax(x))


@torch.inference_mode()
def observe_kv_amax(model, token_ids: list[list[int]], num_layers: int, per_head: bool | str = False,
                    k_shift: list | None = None, rotation: torch.Tensor | None = None) -> tuple[list, list]:
    """Run sequences through `model` and return per-layer (k_amax, v_amax):
    numbers, or with per_head a [Hkv] tensor for each layer (of the keys minus k_shift; of keys
    and values turned by `rotation`, when given, as a rotated pool holds them)."""
    observer = observe_kv(model, token_ids, num_layers, per_head, k_shift, rotation)
    return observer.k_amax, observer.v_amax


@torch.inference_mode()
def observe_kv(model, token_ids: list[list[int]], num_layers: int, per_head: bool | str = False,
               k_shift: list | None = None, rotation: torch.Tensor | None = None) -> KVAmaxObserver:
    """Run sequences through `model` under a KVAmaxObserver, one at a time, and return it. The
    amax and the key sums gather over runs, so one flat batch of all of them would give the same
    statistics while holding every sequence's activations at once (SmolLM2's 8 x 512 calibration
    tokens: about 0.6 GB, a third of what a 2 GB container holds)."""
    if not token_ids or not all(token_ids):
        raise ValueError("calibration needs at least one non-empty sequence of token ids")
    device = next(model.parameters()).device
    observer = KVAmaxObserver(num_layers, per_head, k_shift)
    observer.rotation = rotation   # attention turns what it hands the observer, as it does for the pool
    for seq in token_ids:
        run_model(model, observer, torch.tensor(seq, device=device), AttentionMetadata.uncached([len(seq)], device))
    return observer
