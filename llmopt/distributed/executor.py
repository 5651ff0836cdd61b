"""The driver's side: start the workers, hand them each step, collect logits, shut them down.

As vLLM's multiprocessing executor does, the driver process (the one holding the `LLM`)
is rank 0: it schedules and samples, and computes its own shard of stage 0. The other
ranks are fresh Python processes (`python -m llmopt.distributed.worker`), so nothing has
to be importable from the caller's `__main__`: it works the same from a script, a
notebook or the server. Under `torchrun` the ranks already exist: rank 0 becomes the
driver, every other rank a worker (see `serve_torchrun_rank`).

No orphans: workers die with the driver (their stdin, held open by it, ends), exit when
`close()` tells them to or the `LLM` is garbage-collected, and ignore Ctrl-C, which the
driver defers to the end of the step under way so that no rank is left inside a collective.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from collections import deque

import torch
import torch.distributed as dist

from llmopt.distributed.lifetime import dead_ranks, release_distributed, take_over_distributed
from llmopt.distributed.parallel_state import ParallelGrid, destroy_groups, free_port, init_groups, launched_by_torchrun
from llmopt.distributed.pipeline import bubble_fraction, stage_layers
from llmopt.distributed.sharding import attention_heads, kv_heads_per_rank
from llmopt.distributed.worker import Worker, serve
from llmopt.worker.model_runner import ModelRunner, StepOutput


def check_parallel_config(config, model_config, device: torch.device | None = None) -> None:
    """Everything that makes a TP x PP split impossible, before a process starts."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if model_config.mla is not None:
        raise ValueError("tensor_parallel_size / pipeline_parallel_size > 1 do not shard MLA (DeepSeek) models "
                         "yet; use tensor_parallel_size=1 and pipeline_parallel_size=1")
    if device is not None and device.type == "cuda" and not launched_by_torchrun() \
            and tp * pp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {tp * pp} ranks need as many GPUs "
                         f"(NCCL puts one rank on each); this machine has {torch.cuda.device_count()}. "
                         "device='cpu' runs the ranks on the CPU with gloo")
    stage_layers(model_config.num_hidden_layers, pp, 0)
    for r in range(tp):
        attention_heads(model_config.num_attention_heads, model_config.num_key_value_heads, tp, r)
    if tp > model_config.intermediate_size or tp > model_config.vocab_size:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's intermediate size or vocabulary")
    method = (model_config.quantization_config or {}).get("quant_method")
    if tp > 1 and method:
        raise ValueError(f"tensor_parallel_size={tp}: this checkpoint is quantized ({method}), and quantized "
                         "layers are not split across ranks yet; use a full-precision checkpoint with tensor "
                         "parallelism, or pipeline_parallel_size alone (it keeps layers whole)")


class MultiprocExecutor:
    def __init__(self, config, model_path, model_config, dtype, device):
        check_parallel_config(config, model_config, device)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.tp, self.pp, self.config = tp, pp, config
        self.grid = ParallelGrid(tp, pp, 0)
        self.procs: list[subprocess.Popen] = []
        self.dead: str | None = None
        self.superseded = False  # closed by a newer parallel LLM of this process (lifetime.py)
        self._threads_before = None
        take_over_distributed(self, f"a new one (tensor_parallel_size={tp}, pipeline_parallel_size={pp})")
        self._runner = None  # a weak reference: the runner holds the executor, no cycle back
        cfg = model_config
        # what one rank's KV block costs: its stage's layers (the largest stage) and KV heads
        self.kv_layers = max(b - a for a, b in (stage_layers(cfg.num_hidden_layers, pp, s) for s in range(pp)))
        self.kv_heads = kv_heads_per_rank(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != tp * pp:
                raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes; tensor_parallel_size "
                                 f"x pipeline_parallel_size = {tp * pp} must equal WORLD_SIZE")
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            threads = max(1, torch.get_num_threads() // (tp * pp)) if device.type == "cpu" else 1
            args = {"config": config, "tp": tp, "pp": pp, "init_method": init_method, "parent": os.getpid(),
                    "model_path": model_path, "dtype": dtype, "device": str(device), "threads": threads}
            for rank in range(1, tp * pp):
                dev = torch.device("cuda", rank % torch.cuda.device_count()) if device.type == "cuda" else device
                self.procs.append(_spawn({**args, "rank": rank, "device": str(dev)}))
            if device.type == "cpu":  # the driver's share of the cores (given back by close())
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(threads)
        # close(), or the LLM garbage-collected, or Python exiting: the same orderly stop
        self._stopper = _Stopper(self.grid, self.procs)
        self._finalizer = weakref.finalize(self, self._stopper)
        try:
            self.tp_group = self._stopper.tp_group = init_groups(self.grid, device, init_method)
            self.worker = Worker(config, self.grid, self.tp_group, model_path, dtype, device)
            self._stopper.link = self.worker.link
        except BaseException:
            self.close(failed=True)
            raise
        self.model = self.worker.model
        self.micro_batches = 0           # submitted so far
        self.tokens_forwarded = 0        # new tokens through the model so far
        self.max_in_flight = pp          # 1 shows the bubble a pipeline has without micro-batching

    # -- set-up ----------------------------------------------------------------------------
    def init_kv_cache(self, num_blocks: int):
        dist.broadcast_object_list([num_blocks], src=0)
        return self.worker.init_kv_cache(num_blocks)

    def make_runner(self, model, kv_cache, block_size, device, eos_token_ids):
        """The engine's model runner, with the forward done by every rank (`model`: the driver's shard)."""
        runner = ParallelModelRunner(self, kv_cache, block_size, device, eos_token_ids)
        self._runner = weakref.ref(runner)
        return runner

    # -- one micro-batch -----------------------------------------------------------------------
    def submit(self, meta: dict):
        """Start a micro-batch down the pipeline; on one stage, its logits come back at once."""
        self._check_alive()
        meta["micro_batch"] = self.micro_batches
        self.micro_batches += 1
        self.tokens_forwarded += len(meta["ids"])
        try:
            with deferred_interrupt():
                if self.tp > 1:
                    dist.broadcast_object_list([meta], src=0, group=self.tp_group)
                return self.worker.run_step(meta)
        except (RuntimeError, dist.DistBackendError) as e:
            raise self._fail(e) from e

    def recv_logits(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """The last stage's logits for a micro-batch submitted earlier (in order)."""
        buf = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=self.worker.device)
        try:
            with deferred_interrupt():
                dist.recv(buf, (self.pp - 1) * self.tp)
        except (RuntimeError, dist.DistBackendError) as e:
            raise self._fail(e) from e
        return buf

    def report(self, reset: bool = False) -> list[dict]:
        """Every rank's measurements (timeline, all-reduce bytes and seconds, compute seconds),
        in rank order; with reset=True they start again from zero."""
        self._check_alive()
        meta = {"op": "report", "reset": reset}
        with deferred_interrupt():
            if self.tp > 1:
                dist.broadcast_object_list([meta], src=0, group=self.tp_group)
            if self.pp > 1:
                w = self.worker
                w.link.send(self.grid.next_peer, meta, torch.empty(0, w.link.hidden_size, dtype=w.dtype,
                                                                   device=w.device))
            out = [None] * (self.tp * self.pp)
            dist.gather_object(self.worker.report(), out, dst=0)
        if reset:
            self.worker.reset_stats()
        return out

    def bubble(self, reports: list[dict]) -> float:
        stages = [[] for _ in range(self.pp)]
        for r in reports:
            if r["tp_rank"] == 0:
                stages[r["pp_rank"]] = r["timeline"]
        return bubble_fraction(stages)

    # -- shutting down -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:  # (no stopper yet: it failed before starting anything)
        return getattr(self, "_stopper", None) is None or self._stopper.closed

    def _check_alive(self) -> None:
        if self.dead:
            raise RuntimeError(self.dead)
        if self._stopper.closed:
            raise RuntimeError("this LLM was closed by a newer parallel LLM built in this process (one holds "
                               "torch.distributed at a time); use that one, or create a new one"
                               if self.superseded else "this LLM was closed; create a new one")
        if any(p.poll() is not None for p in self.procs):  # died between two steps: say so before any collective
            raise self._fail(None)

    def _fail(self, error: Exception | None) -> RuntimeError:
        gone = dead_ranks(self.procs, wait=2.0 if error is not None else 0.0)
        self.dead = (f"the parallel workers stopped: {', '.join(gone) or error} (a worker that raised printed "
                     "its traceback on stderr). This LLM cannot run further steps; its other workers are "
                     "stopped, so a new LLM can be built in this process")
        self.close(failed=True)
        return RuntimeError(self.dead)

    def close(self, failed: bool = False) -> None:
        """Tell the workers to stop and wait for them (up to 30 s); kill what is left. After
        a failure nobody is listening any more: they are terminated at once."""
        self._finalizer.detach()
        if not failed and not self._stopper.closed:
            try:  # logits still on their way back are received first: the pipeline ends empty
                runner = self._runner() if self._runner is not None else None
                while runner is not None and runner.pending:
                    rows, index, logits = runner.pending.popleft()
                    if rows and logits is None:
                        self.recv_logits(len(index), self.model.config.vocab_size)
            except Exception:
                failed = True
        self._stopper(graceful=not failed)
        release_distributed(self)
        if self._threads_before:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None


class _Stopper:
    """Stops the workers; holds no reference to the executor, so that it can run when the
    executor is garbage-collected (weakref.finalize), at exit included."""

    def __init__(self, grid: ParallelGrid, procs: list):
        self.grid, self.procs = grid, procs
        self.tp_group = self.link = None
        self.closed = False

    def __call__(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and dist.is_initialized() and self.link is not None:
            try:
                with deferred_interrupt():
                    if self.grid.tp > 1:
                        dist.broadcast_object_list([None], src=0, group=self.tp_group)
                    if self.grid.pp > 1:
                        self.link.send(self.grid.next_peer, None)
                        self.link.flush()
            except Exception:
                graceful = False  # they are terminated below
        for p in self.procs:  # wait, then terminate, then kill: never leave one behind
            try:
                p.wait(timeout=30.0 if graceful else 0.5)  # a loaded machine may need it
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            with contextlib.suppress(OSError):
                p.stdin.close()
        with contextlib.suppress(Exception):
            destroy_groups()


def _spawn(args: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "llmopt.distributed.worker"], stdin=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": str(args["threads"]),
                                 "MKL_NUM_THREADS": str(args["threads"])})  # MKL's own count too, where set
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.flush()  # stdin stays open: its end of file tells the worker the driver is gone
    return proc


@contextlib.contextmanager
def deferred_interrupt():
    """Ctrl-C during a step takes effect when the step ends: every rank takes part in every
    collective, so leaving one half-way would leave the others waiting forever (and the
    driver's record of what is in flight must match the workers'). Re-entrant: the outermost
    one raises."""
    if threading.current_thread() is not threading.main_thread() or _deferring:
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


_deferring: list[bool] = []


class ParallelModelRunner(ModelRunner):
    """The model runner with the forward done by the ranks: the driver sends the step's
    token ids and block tables, computes its shard, and samples from the gathered logits.
    With a pipeline, up to `max_in_flight` steps are submitted before the oldest is collected;
    the record of what is in flight is kept here, in step with the workers."""

    def __init__(self, executor: MultiprocExecutor, kv_cache, block_size, device, eos_token_ids):
        super().__init__(executor.model, kv_cache, block_size, device, eos_token_ids)
        self.executor = executor
        self.pending: deque = deque()  # (sampling rows, logits index, grammar bitmask, logits or None)

    @property
    def max_in_flight(self) -> int:
        return self.executor.max_in_flight

    def submit(self, scheduled, block_tables, grammar_bitmask=None) -> None:
        """Start a step down the pipeline (the arguments are `execute`'s)."""
        with deferred_interrupt():  # what is in flight must stay in step with the workers
            ids, starts, lens, tables = self.step_inputs(scheduled, block_tables)
            tables = [list(t) for t in tables]  # as they are now: the block manager goes on changing them
            rows, index = self.sampling_rows(scheduled)
            meta = {"ids": ids, "starts": starts, "lens": lens, "tables": tables, "index": index}
            logits = self.executor.submit(meta)
            self.pending.append((rows, index, grammar_bitmask, logits))

    def collect(self) -> StepOutput:
        """The oldest step in flight, its tokens sampled (steps come back in submission order)."""
        with deferred_interrupt():
            rows, index, grammar_bitmask, logits = self.pending.popleft()
            if not rows:
                return StepOutput({})
            if logits is None:
                logits = self.executor.recv_logits(len(index), self.executor.model.config.vocab_size)
            return StepOutput(self.sample(rows, logits, grammar_bitmask))

    def execute(self, scheduled, block_tables, grammar_bitmask=None) -> StepOutput:
        """One step, submitted and collected (the engine's path when one step is in flight)."""
        with deferred_interrupt():
            self.submit(scheduled, block_tables, grammar_bitmask)
            return self.collect()


def start_workers(config, model_path, model_config, dtype, device) -> MultiprocExecutor:
    """Tensor/pipeline parallel: start the worker ranks and return the driver's handle on them
    (its `model` is the driver's own shard). Under torchrun, on a rank other than 0, serve as
    that rank instead, and exit when the driver shuts down."""
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        serve_torchrun_rank(config, model_path, model_config, dtype, device)
        raise SystemExit(0)
    return MultiprocExecutor(config, model_path, model_config, dtype, device)


def serve_torchrun_rank(config, model_path, model_config, dtype, device) -> None:
    """Under torchrun, a rank other than 0 serves as a worker for the driver on rank 0, and
    returns when the driver shuts down."""
    check_parallel_config(config, model_config)
    if int(os.environ["WORLD_SIZE"]) != config.tensor_parallel_size * config.pipeline_parallel_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes; tensor_parallel_size x "
                         "pipeline_parallel_size must equal WORLD_SIZE")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    grid = ParallelGrid(config.tensor_parallel_size, config.pipeline_parallel_size, int(os.environ["RANK"]))
    serve(config, grid, "env://", model_path, dtype, device)


__all__ = [
    "MultiprocExecutor",
    "ParallelModelRunner",
    "bubble_fraction",
    "check_parallel_config",
    "serve_torchrun_rank",
    "start_workers",
]
