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
- a step replays when every sequence brings the same number q <= MAX_QUERY of new tokens: pure
  decode (q = 1), and speculative verification of a chain of q - 1 drafts, so that checking the
  drafts costs one recorded step too (one graph per bucket and q); prompts, chunks, mixed steps
  and draft trees run eagerly: their shapes vary too much to bucket.

A graph records the whole step, embedding to sampled token, where it can (`decode_tokens`): the
forward with its elementwise work fused (llmopt/worker/fused_decode.py), the head, and the
sampler, its knobs (temperature, top-k, top-p, min-p) in buffers and each sampled row's uniform
drawn from that request's generator before the replay, as the plain sampler draws it
(llmopt/layers/sampler.py); two graphs a bucket, one for all-greedy steps (the argmax alone) and
one that samples. What comes back is a tensor of token ids still on the GPU: the host reads it
when it needs it, and with the overlap (llmopt/engine/overlap.py) the next step is already queued.

A bucket's graph is recorded the first time a step needs it (two eager warm-up runs first, so
that Triton has compiled and cuBLAS has chosen its kernels; the same step's values, written
into the same slots, each time). `enforce_eager=True` keeps the plain path, the reference.

On the CPU the same buffers and buckets run with `capture=call_again` (each replay calls the
recorded function again): that is how the tests hold the padding and buffer logic to the eager
path's greedy tokens without a GPU; benchmarks/gpu_check.py records and times real graphs.
"""

from __future__ import annotations

import torch

from llmopt.layers import sampler
from llmopt.layers.attention import AttentionMetadata, host_to_device
from llmopt.model.forward import run_model
from llmopt.worker.fused_decode import fused_forward, why_not_fused
from llmopt.worker.model_runner import StepBackend

BUCKETS = (1, 2, 4, 8, *range(16, 1025, 16))
MAX_QUERY = 8  # new tokens a sequence may bring to a recorded step: a verification of up to 7 drafts


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

    def __init__(self, model, kv_cache, max_num_seqs: int, max_blocks_per_seq: int, capture=None,
                 fused: bool | None = None):
        self.model, self.kv_cache = model, kv_cache
        device = next(model.parameters()).device
        # the elementwise kernels where they run (None: wherever why_not_fused allows)
        self.why_not_fused = why_not_fused(model, device) if fused in (None, True) else "fused=False"
        if fused and self.why_not_fused:
            raise ValueError(f"fused=True, but the fused step cannot run this model: {self.why_not_fused}")
        self.fused = self.why_not_fused is None
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        n = self.buckets[-1]
        # per token (up to MAX_QUERY a sequence), then per sequence
        self.ids = torch.zeros(n * MAX_QUERY, dtype=torch.long, device=device)
        self.positions = torch.zeros(n * MAX_QUERY, dtype=torch.long, device=device)
        self.slots = torch.zeros(n * MAX_QUERY, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_starts = {q: torch.arange(n + 1, dtype=torch.int32, device=device) * q  # where each row's
                             for q in range(1, MAX_QUERY + 1)}                             # tokens start
        # the sampler's knobs and uniforms, per row (padding rows greedy)
        self.temperature = torch.ones(n, device=device)
        self.top_k = torch.zeros(n, dtype=torch.long, device=device)
        self.top_p = torch.ones(n, device=device)
        self.min_p = torch.zeros(n, device=device)
        self.greedy = torch.ones(n, dtype=torch.bool, device=device)
        self.u = torch.zeros(n, dtype=torch.float64, device=device)
        self.zero_u = torch.zeros((), dtype=torch.float64, device=device)
        if capture is None:  # every bucket's graph allocates from one shared memory pool
            pool = torch.cuda.graph_pool_handle()
            capture = lambda fn: cuda_capture(fn, pool)  # noqa: E731
        self.capture = capture
        self.metas: dict[tuple, AttentionMetadata] = {}  # (bucket, q): the recorded steps' metadata
        self.replays: dict[tuple, object] = {}  # (bucket, q, what it gives): its replay
        self.replayed = {b: 0 for b in self.buckets}  # steps per bucket (tests and benchmarks read it)
        self.failed: str | None = None  # why a capture failed: from then on every step runs eagerly

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def runs(self, meta: AttentionMetadata) -> bool:
        """A step of q <= MAX_QUERY new tokens for every sequence, no draft tree, that fits the buffers."""
        q = meta.query_lens[0]
        return (self.failed is None and meta.tree_masks is None and q <= MAX_QUERY
                and all(n == q for n in meta.query_lens) and len(meta.query_lens) <= self.buckets[-1]
                and meta.block_table_tensor.shape[1] <= self.tables.shape[1])

    def _hidden(self, b: int, q: int) -> torch.Tensor:
        """The recorded forward over the buffers' first b rows of q tokens."""
        step = fused_forward if self.fused else run_model
        return step(self.model, self.kv_cache, self.ids[:b * q], self.metas[b, q])

    def _replay(self, key, record, meta, B: int, b: int, q: int):
        """Replay graph `key` (recorded from `record` the first time); None if it cannot be recorded."""
        if (b, q) not in self.metas:
            self.metas[b, q] = self._static_meta(meta, B, b, q)
        else:
            self._refresh_lists(self.metas[b, q], meta, B, b)
        if key not in self.replays:
            try:
                self.replays[key] = self.capture(record)
            except Exception as e:  # noqa: BLE001 - an op that cannot be recorded: serve on, eagerly, and say why
                self.failed = f"capturing bucket {key[0]}, q={key[1]} ({key[2]}): {type(e).__name__}: {e}"
                return None
        out = self.replays[key]()
        self.replayed[b] += 1
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.runs(meta):  # step choice: backend (a step that is not a pure decode runs eagerly)
            return super().forward(input_ids, meta)
        B, q = len(meta.query_lens), meta.query_lens[0]
        b = self.bucket(B)
        self._fill(input_ids, meta, B, b, q)
        hidden = self._replay((b, q, "hidden"), lambda: self._hidden(b, q), meta, B, b, q)
        if hidden is None:
            return super().forward(input_ids, meta)
        return hidden[:B * q].clone()  # the graph's output buffer is overwritten by the next replay

    @torch.inference_mode()
    def decode_tokens(self, input_ids: torch.Tensor, meta: AttentionMetadata, params: list,
                      generators: list) -> torch.Tensor:
        """The base's contract, the whole step one graph replay (the module's note)."""
        if not (self.runs(meta) and meta.is_decode):  # step choice: backend (not a pure decode: eagerly)
            return super().decode_tokens(input_ids, meta, params, generators)
        B = len(meta.query_lens)
        b = self.bucket(B)
        self._fill(input_ids, meta, B, b, 1)
        draws = not all(p.greedy for p in params)
        if draws:
            self._fill_sampler(params, generators, B, b)

        def record():
            logits = self.model.compute_logits(self._hidden(b, 1))
            if not draws:
                return sampler.greedy_tokens(logits)
            # (a greedy row's knobs are 1, or a former row's: valid, and its draw unused)
            probs = sampler.filter_logits(logits, self.temperature[:b], self.top_k[:b], self.top_p[:b],
                                          self.min_p[:b]).exp()
            return torch.where(self.greedy[:b], sampler.greedy_tokens(logits),
                               sampler.draw_from_uniforms(probs, self.u[:b]))
        tokens = self._replay((b, 1, "draws" if draws else "greedy"), record, meta, B, b, 1)
        if tokens is None:
            return super().decode_tokens(input_ids, meta, params, generators)
        return tokens[:B].clone()

    def _fill_sampler(self, params, generators, B, b) -> None:
        """Each row's knobs, and one uniform from each sampled row's generator (none for a greedy
        row), as the plain sampler takes them; padding rows greedy."""
        dev = self.u.device
        self.greedy[:B].copy_(host_to_device([p.greedy for p in params], torch.bool, dev))
        self.greedy[B:b] = True
        for buf, values in ((self.temperature, [p.temperature if not p.greedy else 1.0 for p in params]),
                            (self.top_k, [min(p.top_k, 1 << 62) for p in params]),
                            (self.top_p, [p.top_p for p in params]), (self.min_p, [p.min_p for p in params])):
            buf[:B].copy_(host_to_device(values, buf.dtype, dev))
        self.u[:B].copy_(torch.stack([self.zero_u if p.greedy else sampler.uniforms([g], dev)[0]
                                      for p, g in zip(params, generators)]))

    def _fill(self, input_ids, meta, B, b, q) -> None:
        """The step into the buffers' first B rows of q tokens; rows B..b copy row 0 (the module's note)."""
        w = meta.block_table_tensor.shape[1]
        for buf, src in ((self.ids, input_ids), (self.positions, meta.positions), (self.slots, meta.slot_mapping)):
            buf[:B * q].copy_(src)
            buf[B * q:b * q].copy_(src[:q].repeat(b - B))
        self.seq_lens[:B].copy_(meta.seq_lens_tensor)
        self.seq_lens[B:b].copy_(meta.seq_lens_tensor[:1].expand(b - B))
        self.tables[:B, :w].copy_(meta.block_table_tensor)
        self.tables[B:b, :w].copy_(meta.block_table_tensor[:1].expand(b - B, w))

    def _static_meta(self, meta, B, b, q) -> AttentionMetadata:
        static = AttentionMetadata(
            [q] * b, [], self.positions[:b * q], block_tables=[], slot_mapping=self.slots[:b * q],
            block_table_tensor=self.tables[:b], query_start_loc=self.query_starts[q][:b + 1],
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
