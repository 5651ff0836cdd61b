"""Decode steps replayed as CUDA graphs: the GPU's way to a step without per-op overhead.

A decode step of a small model launches a few hundred kernels, each costing microseconds of
CPU time to launch; at small batch on a GPU those launches, not the weights, set the step time,
as Python's per-op overhead does on the CPU (where llmopt/worker/compiled_decode.py runs the
step in one C++ call instead). A CUDA graph records one step's launches once and replays them
all with one call. A graph replays the same kernels on the same memory, so, as vLLM does:

- a step's inputs are copied into static buffers the graph reads: token ids, positions, slots,
  block tables padded to the most blocks a sequence may have, sequence lengths;
- there is one graph per batch-size bucket (1, 2, 4, 8, then multiples of 16 up to
  max_num_seqs); a step of B sequences replays the smallest bucket >= B, its extra rows copies
  of the first sequence (the same token, position and slot: they write the same key and value
  into the slot that sequence owns anyway, and their outputs are dropped), so no slot of
  another request is touched;
- the kernels read every length from those buffers (the Triton decode kernel walks each
  sequence's blocks up to its seq_len), so one graph serves any context up to max_model_len;
- only pure decode steps replay (one new token per sequence, no draft tree); prompts, chunks,
  mixed and verification steps run eagerly: their shapes vary too much to bucket.

A bucket's graph is recorded the first time a step needs it (two eager warm-up runs first, so
that Triton has compiled and cuBLAS has chosen its kernels; the same step's values, written
into the same slots, each time). `enforce_eager=True` keeps the plain path, the reference.

On the CPU the same buffers and buckets run with `capture=call_again` (each replay calls the
recorded function again): that is how the tests hold the padding and buffer logic to the eager
path's greedy tokens without a GPU; benchmarks/gpu_check.py records and times real graphs.
"""

from __future__ import annotations

import torch

from llmopt.layers.attention import AttentionMetadata
from llmopt.model.forward import run_model
from llmopt.worker.model_runner import StepBackend

BUCKETS = (1, 2, 4, 8, *range(16, 1025, 16))


def why_not_graphs(model, kv_cache, device) -> str | None:
    """Why decode steps cannot be replayed as CUDA graphs here (None when they can)."""
    if torch.device(device).type != "cuda":
        return "CUDA graphs need a CUDA device"
    if getattr(kv_cache, "layout", None) != "paged" or kv_cache.attention != "triton":
        # the torch path plans its gathers from Python lists: a graph would replay the first step's
        return "the KV pool is not read by the Triton kernels (their lengths come from tensors)"
    return None


def call_again(fn):
    """A stand-in for a graph where there is no GPU: replaying calls `fn` again."""
    return fn


def cuda_capture(fn, pool=None):
    """Record `fn`'s launches as a CUDA graph; returns a replay that gives fn's (static) output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # Triton compiles, cuBLAS picks its kernels: nothing of that may be recorded
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay


class GraphedDecode(StepBackend):
    """CUDA's step backend (llmopt/worker/model_runner.py): `forward(input_ids, meta)` = the model's
    hidden states for a step, a decode step by replaying the graph of its batch-size bucket, any
    other step (`runs(meta)` is False) eagerly over the same Triton kernels."""

    path = "cuda graphs"

    def __init__(self, model, kv_cache, max_num_seqs: int, max_blocks_per_seq: int, capture=None):
        self.model, self.kv_cache = model, kv_cache
        device = next(model.parameters()).device
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        if capture is None:  # every bucket's graph allocates from one shared memory pool
            pool = torch.cuda.graph_pool_handle()
            capture = lambda fn: cuda_capture(fn, pool)  # noqa: E731
        self.capture = capture
        self.metas: dict[int, AttentionMetadata] = {}
        self.replays: dict[int, object] = {}
        self.replayed = {b: 0 for b in self.buckets}  # steps per bucket (tests and benchmarks read it)
        self.failed: str | None = None  # why a capture failed: from then on every step runs eagerly

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def runs(self, meta: AttentionMetadata) -> bool:
        """A pure decode step that fits the buffers."""
        return (self.failed is None and meta.tree_masks is None and meta.is_decode
                and len(meta.query_lens) <= self.buckets[-1]
                and meta.block_table_tensor.shape[1] <= self.tables.shape[1])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.runs(meta):  # step choice: backend (a step that is not a pure decode runs eagerly)
            return super().forward(input_ids, meta)
        B = len(meta.query_lens)
        b = self.bucket(B)
        self._fill(input_ids, meta, B, b)
        if b not in self.replays:
            self.metas[b] = self._static_meta(meta, B, b)
            static = self.metas[b]
            try:
                self.replays[b] = self.capture(lambda: run_model(self.model, self.kv_cache, self.ids[:b], static))
            except Exception as e:  # noqa: BLE001 - an op that cannot be recorded: serve on, eagerly, and say why
                self.failed = f"capturing bucket {b}: {type(e).__name__}: {e}"
                return super().forward(input_ids, meta)
        else:
            self._refresh_lists(self.metas[b], meta, B, b)
        hidden = self.replays[b]()
        self.replayed[b] += 1
        return hidden[:B].clone()  # the graph's output buffer is overwritten by the next replay

    def _fill(self, input_ids, meta, B, b) -> None:
        """The step into the buffers' first B rows; rows B..b copy row 0 (see the module's note)."""
        w = meta.block_table_tensor.shape[1]
        for buf, src in ((self.ids, input_ids), (self.positions, meta.positions),
                         (self.slots, meta.slot_mapping), (self.seq_lens, meta.seq_lens_tensor)):
            buf[:B].copy_(src)
            buf[B:b].copy_(src[:1].expand(b - B))
        self.tables[:B, :w].copy_(meta.block_table_tensor)
        self.tables[B:b, :w].copy_(meta.block_table_tensor[:1].expand(b - B, w))

    def _static_meta(self, meta, B, b) -> AttentionMetadata:
        static = AttentionMetadata(
            [1] * b, [], self.positions[:b], block_tables=[], slot_mapping=self.slots[:b],
            block_table_tensor=self.tables[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens_tensor=self.seq_lens[:b])
        self._refresh_lists(static, meta, B, b)
        return static

    @staticmethod
    def _refresh_lists(static, meta, B, b) -> None:
        """The metadata's Python lists, for code that re-runs between replays (call_again: the CPU's
        torch attention path plans from them; a CUDA graph never reads them again)."""
        static.context_lens[:] = list(meta.context_lens) + [meta.context_lens[0]] * (b - B)
        static.block_tables[:] = list(meta.block_tables) + [meta.block_tables[0]] * (b - B)
        static.plans.clear()
