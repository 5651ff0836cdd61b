"""Pipeline parallelism: the layers cut into stages, activations handed down the line.

Stage s holds layers [lo, hi) (an even split); the first stage also embeds the tokens, the
last also normalizes and computes logits. A step's micro-batch enters stage 0, and each
stage sends its output hidden states, with the step's metadata, to the same TP rank of the
next stage. Sends are asynchronous, so a stage starts on the next micro-batch while the
previous one is still on its way: with `pipeline_parallel_size` micro-batches in flight,
every stage has work (vLLM's virtual engines). With one, all stages but one sit idle: the
pipeline bubble, (pp - 1) / pp of the time.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from llmopt.distributed.sharding import even_split


def stage_layers(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    if num_layers < pp:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers; "
                         f"allowed: 1..{num_layers}")
    return even_split(num_layers, pp, stage)


def keep_stage(model, lo: int, hi: int, first: bool, last: bool) -> None:
    """Drop every layer outside [lo, hi) and what only other stages need; layer i becomes i - lo
    (each stage's KV pool holds only its own layers)."""
    inner = model.model
    inner.layers = nn.ModuleList(inner.layers[lo:hi])
    for i, layer in enumerate(inner.layers):
        layer.self_attn.layer_idx = i
    if not first:
        inner.embed_tokens = None  # (a tied lm_head keeps its own reference to the matrix)
    if not last:
        model.lm_head = None


def stage_forward(model, input_ids, meta, hidden, kv_cache, first: bool, last: bool):
    """Run this stage's layers: token ids in on the first stage, hidden states otherwise;
    normalized hidden states out on the last stage."""
    inner = model.model
    x = inner.embed_tokens(input_ids) if first else hidden
    for layer in inner.layers:
        x = layer(meta, x, inner.rotary_emb, kv_cache)
    return inner.norm(x) if last else x


class StageLink:
    """Point-to-point between one rank and its peer in the next (or previous) stage: a header
    [metadata bytes, tokens], the pickled metadata, then the hidden states. Metadata of -1
    bytes means shut down."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.pending: list = []  # (work, tensors kept alive until sent)

    def send(self, peer: int, meta: dict | None, hidden: torch.Tensor | None = None) -> None:
        self._reap()
        if meta is None:
            header = torch.tensor([-1, 0], dtype=torch.int64)
            self.pending.append((dist.isend(header, peer), header))
            return
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
        header = torch.tensor([blob.numel(), hidden.shape[0]], dtype=torch.int64)
        hidden = hidden.contiguous()
        for t in (header, blob, hidden):
            self.pending.append((dist.isend(t, peer), t))

    def recv(self, peer: int) -> tuple[dict, torch.Tensor] | None:
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, peer)
        nbytes, ntokens = header.tolist()
        if nbytes < 0:
            return None
        blob = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(blob, peer)
        hidden = torch.empty(ntokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, peer)
        return pickle.loads(blob.numpy().tobytes()), hidden

    def _reap(self) -> None:
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every send to complete (at shutdown: at most `timeout` seconds each, as a
        driver that stopped listening will not receive what was still on its way)."""
        for w, _ in self.pending:
            if timeout is None:
                w.wait()
            else:
                try:
                    w.wait(timedelta(seconds=timeout))
                except RuntimeError:
                    pass
        self.pending = []


class StageTimeline:
    """When this rank computed which micro-batch (wall-clock seconds): the pipeline bubble is
    read from these, stage by stage."""

    def __init__(self, limit: int = 4096):
        self.spans: list[tuple[int, float, float]] = []
        self.limit = limit

    def record(self, micro_batch: int, start: float) -> None:
        if len(self.spans) < self.limit:
            self.spans.append((micro_batch, start, time.time()))


def bubble_fraction(spans_by_stage: list[list[tuple[int, float, float]]]) -> float:
    """Share of stage-time spent idle between the first micro-batch's start and the last one's
    end: 1 - busy / (stages x makespan)."""
    spans = [s for stage in spans_by_stage for s in stage]
    if not spans:
        return 0.0
    t0, t1 = min(s[1] for s in spans), max(s[2] for s in spans)
    busy = sum(e - b for _, b, e in spans)
    return 1.0 - busy / (len(spans_by_stage) * (t1 - t0)) if t1 > t0 else 0.0
