"""Megatron-style tensor parallelism: each rank holds a slice of every matrix.

A decoder layer needs only two all-reduces (Shoeybi et al., Megatron-LM, 2019):

    x -> qkv (column-parallel: each rank its heads' rows) -> attention on its heads
      -> o (row-parallel: each rank its heads' columns) -> all-reduce -> + residual
    x -> gate_up (column-parallel: a slice of the intermediate dimension) -> silu * up
      -> down (row-parallel: the same slice of its columns) -> all-reduce -> + residual

Column-parallel outputs stay on their rank (a head, or a slice of the MLP, is computed
whole there), so nothing is exchanged until the row-parallel matmul, whose partial sums
add up to the full result. Heads are split by KV group: each rank gets whole groups of
query heads with their KV head; with fewer KV heads than ranks each KV head is replicated
on tp / num_kv_heads ranks and its query heads divided among them (as vLLM does). Unlike
vLLM, a head count that does not divide evenly is split as evenly as whole KV groups
allow (SmolLM2's 3 KV groups over 2 ranks: 2 and 1), so the shards differ in size.

The embedding and lm_head are vocab-parallel: each rank holds a range of token rows; a
token's embedding comes from the rank that holds it (the others contribute zeros to an
all-reduce), and the logits are the ranks' slices gathered side by side.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def even_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of `parts` contiguous ranges covering 0..n, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (i < extra)


def attention_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query head range, KV head range) that TP rank `rank` computes."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp:
        lo, hi = even_split(num_kv_heads, tp, rank)
        return (lo * group, hi * group), (lo, hi)
    if tp % num_kv_heads or group % (tp // num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split {num_heads} attention heads with {num_kv_heads} KV "
            f"heads: with fewer KV heads than ranks, tensor_parallel_size must be a multiple of "
            f"{num_kv_heads} and divide each group of {group} query heads evenly; allowed: "
            f"{', '.join(str(t) for t in valid_tp_sizes(num_heads, num_kv_heads))}")
    replicas = tp // num_kv_heads
    kv = rank // replicas
    per = group // replicas
    q0 = kv * group + (rank % replicas) * per
    return (q0, q0 + per), (kv, kv + 1)


def valid_tp_sizes(num_heads: int, num_kv_heads: int, up_to: int = 64) -> list[int]:
    group = num_heads // num_kv_heads
    return [t for t in range(1, up_to + 1)
            if t <= num_kv_heads or (t % num_kv_heads == 0 and group % (t // num_kv_heads) == 0)]


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_slice @ W[:, slice].T) + b: the partial sums of every rank add up."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.bytes_reduced, self.seconds = 0, 0.0  # the benchmark and lesson 09 read these

    def forward(self, x):
        y = F.linear(x, self.weight)
        self.bytes_reduced += y.numel() * y.element_size()
        start = time.perf_counter()  # the wait for the slowest rank counts too: it is the cost
        dist.all_reduce(y, group=self.group)
        self.seconds += time.perf_counter() - start
        return y if self.bias is None else y + self.bias  # the bias once, after the sum


class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start..vocab_end of the embedding; other tokens embed as zeros here."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + weight.shape[0]
        self.group = group
        self.bytes_reduced, self.seconds = 0, 0.0

    def forward(self, ids):
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        self.bytes_reduced += x.numel() * x.element_size()
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.seconds += time.perf_counter() - start
        return x


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary slice; the slices are gathered side by side."""

    def __init__(self, weight: nn.Parameter, group, slice_sizes: list[int]):
        super().__init__()
        self.weight = weight  # may be the embedding's (tied) slice
        self.group = group
        self.slice_sizes = slice_sizes  # every rank's, which may differ by one row

    def forward(self, hidden):
        local = F.linear(hidden, self.weight).contiguous()
        parts = [local.new_empty(local.shape[0], n) for n in self.slice_sizes]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def _rows(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in ranges]).clone()


def check_shardable(model) -> None:
    """Tensor parallelism slices nn.Linear weights; quantized modules are refused by name."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") and type(module) is not nn.Linear:
            raise ValueError(
                f"tensor_parallel_size > 1 cannot shard {name} ({type(module).__name__}): quantized "
                "layers (GPTQ, AWQ, FP8, int8) are not split across ranks yet; use a full-precision "
                "checkpoint with tensor parallelism, or pipeline_parallel_size alone (it keeps layers whole)")


@torch.no_grad()
def shard_llama(model, tp: int, rank: int, group) -> None:
    """Cut a loaded Llama-family model down to TP rank `rank`'s slices, in place."""
    check_shardable(model)
    cfg = model.config
    hd, H, Hkv, I, V = (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.intermediate_size, cfg.vocab_size)
    (q0, q1), (k0, k1) = attention_heads(H, Hkv, tp, rank)
    i0, i1 = even_split(I, tp, rank)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        ranges = [(q0 * hd, q1 * hd), (H * hd + k0 * hd, H * hd + k1 * hd),
                  ((H + Hkv) * hd + k0 * hd, (H + Hkv) * hd + k1 * hd)]
        new = nn.Linear(qkv.in_features, sum(b - a for a, b in ranges), bias=qkv.bias is not None,
                        device="meta")
        new.weight = nn.Parameter(_rows(qkv.weight, ranges), requires_grad=False)
        if qkv.bias is not None:
            new.bias = nn.Parameter(_rows(qkv.bias, ranges), requires_grad=False)
        attn.qkv_proj = new
        attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
        attn.q_size, attn.kv_size = (q1 - q0) * hd, (k1 - k0) * hd
        o = attn.o_proj
        attn.o_proj = RowParallelLinear(o.weight[:, q0 * hd:q1 * hd].clone(), o.bias, group)

        gu = mlp.gate_up_proj
        ranges = [(i0, i1), (I + i0, I + i1)]
        new = nn.Linear(gu.in_features, 2 * (i1 - i0), bias=gu.bias is not None, device="meta")
        new.weight = nn.Parameter(_rows(gu.weight, ranges), requires_grad=False)
        if gu.bias is not None:
            new.bias = nn.Parameter(_rows(gu.bias, ranges), requires_grad=False)
        mlp.gate_up_proj = new
        d = mlp.down_proj
        mlp.down_proj = RowParallelLinear(d.weight[:, i0:i1].clone(), d.bias, group)

    v0, v1 = even_split(V, tp, rank)
    # a pipeline stage may hold only one of the two (the first the embedding, the last lm_head)
    embed, head = model.model.embed_tokens, model.lm_head
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:
        model.model.embed_tokens = VocabParallelEmbedding(embed.weight[v0:v1].clone(), v0, group)
    if head is not None:
        weight = (model.model.embed_tokens.weight if tied
                  else nn.Parameter(head.weight[v0:v1].clone(), requires_grad=False))
        model.lm_head = VocabParallelLMHead(weight, group, [b - a for a, b in (even_split(V, tp, r)
                                                                                for r in range(tp))])


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """The most KV heads any TP rank holds: what one rank's KV block costs."""
    return max(k1 - k0 for _, (k0, k1) in (attention_heads(num_heads, num_kv_heads, tp, r) for r in range(tp)))
