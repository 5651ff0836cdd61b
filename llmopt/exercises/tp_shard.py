"""Lesson 09's exercise: a TP rank's slice of a linear's weight, column- or row-parallel.

A column-parallel linear gives each rank some of the weight's rows (output features it then
computes whole); a row-parallel one gives it the matching columns (it reads only its own features
and yields a partial sum). Sizes that do not divide are split as the engine's `even_split` does:
contiguous ranges, the first ranks one larger. The split of a weight is the piece every other
part of `shard_llama` is built from (the query/KV head ranges are the same rule applied to whole
KV groups), so it is the one to write. The check holds it against `even_split`'s ranges; the live
run computes every MLP and `o_proj` of `tiny` as TP 2 from the learner's shards, the ranks in turn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.distributed.sharding import even_split
from llmopt.exercises.base import Case, Exercise


def shard_linear_solution(weight: torch.Tensor, tp: int, rank: int, parallel: str) -> torch.Tensor:
    """Rank `rank`'s slice of weight [out, in] under `tp`-way tensor parallelism: its rows
    ("column"-parallel) or its columns ("row"-parallel), the first out % tp (in % tp) ranks one larger."""
    dim = 0 if parallel == "column" else 1   # column-parallel splits the outputs, row-parallel the inputs
    base, extra = divmod(weight.shape[dim], tp)
    lo = rank * base + min(rank, extra)       # every rank before this one that got an extra row or column
    hi = lo + base + (rank < extra)
    return weight.narrow(dim, lo, hi - lo)


def engine_shard(weight: torch.Tensor, tp: int, rank: int, parallel: str) -> torch.Tensor:
    """The slice `shard_llama` cuts, by the engine's own `even_split`."""
    lo, hi = even_split(weight.shape[0 if parallel == "column" else 1], tp, rank)
    return weight[lo:hi] if parallel == "column" else weight[:, lo:hi]


# (shape [out, in], tp, rank, parallel, note). Numbered weights (0, 1, 2, ... row by row), so the
# values the report shows say which rows or columns a function took.
CASES = [((8, 4), 2, 0, "column", "sizes that divide: rank 0 of 2"),
         ((8, 4), 2, 1, "column", "sizes that divide: rank 1 of 2"),
         ((4, 8), 2, 1, "row", "row-parallel: the input columns, not the rows"),
         ((6, 6), 2, 0, "row", "a square weight: the wrong dimension has the right shape"),
         ((10, 3), 4, 0, "column", "10 rows on 4 ranks: 3, 3, 2, 2, the first ranks larger"),
         ((10, 3), 4, 3, "column", "10 rows on 4 ranks: the last rank's 2"),
         ((3, 7), 3, 1, "row", "7 columns on 3 ranks: 3, 2, 2"),
         ((2, 640), 3, 2, "row", "tiny's down_proj inputs (640) on 3 ranks: 214, 213, 213"),
         ((5, 2), 8, 6, "column", "more ranks than rows: the last ranks hold none")]


def cases():
    for shape, tp, rank, parallel, note in CASES:
        w = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        yield Case({"weight": w, "tp": tp, "rank": rank, "parallel": parallel}, engine_shard(w, tp, rank, parallel),
                   lambda fn, w=w, t=tp, r=rank, p=parallel: fn(w.clone(), t, r, p), note=note)


class AllReduceCount:
    """What the all-reduces of a run would have carried: calls, and bytes each rank contributes."""

    def __init__(self):
        self.calls, self.bytes_per_rank, self.tokens = 0, 0, 0

    def sum(self, partials: list[torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        self.bytes_per_rank += partials[0].numel() * partials[0].element_size()
        return torch.stack(partials).sum(0)   # every rank ends up with this same sum


class RowParallelInTurn(nn.Module):
    """o_proj with its columns split: rank r multiplies its slice of the attention output (its
    heads) by its columns; the partial sums are added as the all-reduce would add them."""

    def __init__(self, shards: list[torch.Tensor], count: AllReduceCount):
        super().__init__()
        self.shards, self.count = shards, count
        self.starts = [0]
        for w in shards:   # rank r reads the inputs just after rank r - 1's
            self.starts.append(self.starts[-1] + w.shape[1])

    def forward(self, x):
        return self.count.sum([F.linear(x[:, a:b], w) for a, b, w in zip(self.starts, self.starts[1:], self.shards)])


class MLPInTurn(nn.Module):
    """Llama's MLP at TP `len(gate)`: rank r computes its slice of the intermediate features whole
    (column-parallel gate and up, then SiLU), then its partial sum of down_proj (row-parallel)."""

    def __init__(self, gate, up, down, count: AllReduceCount, first: bool):
        super().__init__()
        self.gate, self.up, self.down, self.count, self.first = gate, up, down, count, first

    def forward(self, x):
        if self.first:
            self.count.tokens += x.shape[0]
        return self.count.sum([F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
                               for g, u, d in zip(self.gate, self.up, self.down)])


def _span(a: int, b: int) -> str:
    return f"{a}-{b - 1}" if b > a else "none"


def live(fn) -> str:
    """`tiny` with every decoder layer's MLP and o_proj computed as TP 2 from `fn`'s shards, against
    the unsharded engine; greedy, so the tokens must be the same. At TP 2 (the lesson's) an even split of
    `tiny`'s o_proj columns gives each rank 3 whole heads, the heads `attention_heads` gives it."""
    from llmopt import LLM, SamplingParams
    from llmopt.distributed import cost_model
    from llmopt.distributed.sharding import attention_heads
    from llmopt.viz import format_table

    tp = 2
    llm = LLM("tiny", device="cpu", enforce_eager=True)
    prompts = ["def add(a, b):", "import numpy as np\n", "class Stack:\n    def push"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    model, count = llm.llm_engine.model, AllReduceCount()
    cfg, layers = model.config, model.model.layers
    kept = [(layer.mlp, layer.self_attn.o_proj) for layer in layers]
    try:
        with torch.no_grad():
            for i, layer in enumerate(layers):
                gate, up = layer.mlp.gate_up_proj.weight.chunk(2)   # fused [gate; up]: each half is split alike
                down, o = layer.mlp.down_proj.weight, layer.self_attn.o_proj.weight
                layer.mlp = MLPInTurn([fn(gate, tp, r, "column") for r in range(tp)],
                                      [fn(up, tp, r, "column") for r in range(tp)],
                                      [fn(down, tp, r, "row") for r in range(tp)], count, first=i == 0)
                layer.self_attn.o_proj = RowParallelInTurn([fn(o, tp, r, "row") for r in range(tp)], count)
        yours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        mlp0, o0 = layers[0].mlp, layers[0].self_attn.o_proj
    finally:
        for layer, (mlp, o_proj) in zip(layers, kept):
            layer.mlp, layer.self_attn.o_proj = mlp, o_proj

    hd, rows, start = cfg.head_dim, [], 0
    for r in range(tp):
        (q0, q1), _ = attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp, r)
        n = mlp0.gate[r].shape[0]
        rows.append({"rank": r, "gate rows (and up's)": _span(start, start + n),
                     "down_proj columns": _span(start, start + mlp0.down[r].shape[1]),
                     "o_proj columns": _span(o0.starts[r], o0.starts[r + 1]),
                     "its heads (attention_heads)": f"{_span(q0, q1)}: columns {_span(q0 * hd, q1 * hd)}"})
        start += n
    per_token = count.bytes_per_rank / max(count.tokens, 1)
    formula = cost_model.tp_bytes_per_token(len(layers), cfg.hidden_size, 4, embedding=False)
    lines = [f"TP {tp} in one process: the ranks run one after another here, each on its own shards from your "
             "function, and the row-parallel partial sums are added as the all-reduce would add them.",
             f"layer 0's shards (every layer is cut the same way; intermediate size {cfg.intermediate_size}, "
             f"hidden {cfg.hidden_size}):", format_table(rows)]
    lines += [f"{'same' if y == e else 'DIFFERENT'}: {p!r} -> {llm.tokenizer.decode(y)!r}"
              for p, y, e in zip(prompts, yours, engine)]
    lines.append(f"all-reduces: {count.calls:,} (2 per layer in each of {count.calls // (2 * len(layers))} forwards), "
                 f"over {count.tokens:,} tokens; "
                 f"each rank would send its partial sums, {count.bytes_per_rank:,} bytes in all, "
                 f"{per_token:,.0f} per token (formula 2 x {len(layers)} layers x {cfg.hidden_size} x 4 bytes "
                 f"= {formula:,})")
    lines.append("greedy tokens equal to the unsharded engine's" if yours == engine
                 else "greedy tokens differ from the unsharded engine's")
    return "\n".join(lines)


EXERCISE = Exercise("tp_weight_shard", 9, "cut a linear's weight into a tensor-parallel rank's rows or columns",
                    cases, shard_linear_solution, live)
