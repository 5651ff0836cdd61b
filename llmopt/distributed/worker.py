"""One rank: its shard of the model and of the paged KV pool, and the loop that runs its steps.

Every rank builds the same way: load the checkpoint, keep its pipeline stage's layers,
slice every matrix for its tensor-parallel rank (`sharding`), then allocate a KV pool of
the driver's `num_blocks` blocks for its layers and KV heads. The block tables are the
driver's: a block number means the same slots on every rank, each rank storing its heads.

A worker (every rank but the driver) then loops: stage 0's ranks receive each step's
metadata by broadcast from the driver; later stages receive it with the hidden states
from the stage before. The last stage's TP rank 0 sends the sampled rows' logits back to
the driver. `python -m llmopt.distributed.worker` is how the driver starts one.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from llmopt.distributed.parallel_state import ParallelGrid, destroy_groups, init_groups
from llmopt.distributed.pipeline import StageLink, StageTimeline, keep_stage, stage_forward, stage_layers
from llmopt.distributed.sharding import RowParallelLinear, VocabParallelEmbedding, attention_heads, shard_llama
from llmopt.layers.attention import AttentionMetadata
from llmopt.worker.kv_cache import PagedKVCache

ALL_REDUCING = (RowParallelLinear, VocabParallelEmbedding)  # what counts its bytes and seconds


class Worker:
    def __init__(self, config, grid: ParallelGrid, tp_group, model_path, dtype, device):
        from llmopt.model.llama import LlamaForCausalLM
        from llmopt.model.loader import load_model

        self.config, self.grid, self.tp_group = config, grid, tp_group
        self.dtype, self.device = dtype, device
        torch.manual_seed(config.seed)
        model = load_model(model_path, dtype, device, config.quantization, config.load_format, config.seed)
        if type(model) is not LlamaForCausalLM:
            raise ValueError(f"tensor/pipeline parallelism splits Llama-family decoders; "
                             f"{type(model).__name__} is not one")
        cfg = model.config
        self.layers = stage_layers(cfg.num_hidden_layers, grid.pp, grid.pp_rank)
        keep_stage(model, *self.layers, grid.is_first_stage, grid.is_last_stage)
        if grid.tp > 1:
            shard_llama(model, grid.tp, grid.tp_rank, tp_group)
        self.model = model.eval()
        _, (k0, k1) = attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads, grid.tp, grid.tp_rank)
        self.num_kv_heads, self.head_dim = k1 - k0, cfg.head_dim
        self.link = StageLink(cfg.hidden_size, dtype, device)
        self.timeline = StageTimeline()
        self.compute_seconds = 0.0
        self.kv_cache = None

    def init_kv_cache(self, num_blocks: int) -> PagedKVCache:
        self.kv_cache = PagedKVCache(self.layers[1] - self.layers[0], num_blocks, self.config.block_size,
                                     self.num_kv_heads, self.head_dim, self.dtype, self.device,
                                     kernels=not self.config.enforce_eager)
        return self.kv_cache

    @torch.inference_mode()
    def run_step(self, meta: dict, hidden: torch.Tensor | None = None):
        """This rank's part of one step. Returns the logits on the last stage (else None)."""
        g, start = self.grid, time.time()
        attn = AttentionMetadata.paged(meta["tables"], meta["starts"], meta["lens"], self.config.block_size,
                                       self.device)
        ids = torch.tensor(meta["ids"], device=self.device) if g.is_first_stage else None
        out = stage_forward(self.model, ids, attn, hidden, self.kv_cache, g.is_first_stage,
                            g.is_last_stage)
        logits = None
        if not g.is_last_stage:
            self.link.send(g.next_peer, meta, out)
        elif meta["index"]:
            logits = self.model.compute_logits(out[torch.tensor(meta["index"], device=out.device)])
            if g.rank != 0 and g.tp_rank == 0:
                self.link.pending.append((dist.isend(logits, 0), logits))
        self.compute_seconds += time.time() - start
        self.timeline.record(meta["micro_batch"], start)
        return logits

    def report(self) -> dict:
        """What this rank measured: the benchmark and lesson 09 read it."""
        rows = [m for m in self.model.modules() if isinstance(m, ALL_REDUCING)]
        return {"rank": self.grid.rank, "tp_rank": self.grid.tp_rank, "pp_rank": self.grid.pp_rank,
                "layers": self.layers, "timeline": list(self.timeline.spans),
                "compute_seconds": self.compute_seconds,
                "allreduce_bytes": sum(m.bytes_reduced for m in rows),
                "allreduce_seconds": sum(m.seconds for m in rows),
                "num_parameters": sum(p.numel() for p in self.model.parameters())}

    def reset_stats(self) -> None:
        self.timeline.spans.clear()
        self.compute_seconds = 0.0
        for m in self.model.modules():
            if isinstance(m, ALL_REDUCING):
                m.bytes_reduced, m.seconds = 0, 0.0

    def loop(self) -> None:
        """Serve steps until the driver says stop."""
        g = self.grid
        while True:
            if g.is_first_stage:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=self.tp_group)
                meta, hidden = box[0], None
            else:
                got = self.link.recv(g.prev_peer)
                meta, hidden = got if got is not None else (None, None)
            if meta is None:  # shut down, and tell the next stage
                if not g.is_last_stage:
                    self.link.send(g.next_peer, None)
                self.link.flush(timeout=5.0)
                return
            if meta.get("op") == "report":
                if not g.is_last_stage:
                    self.link.send(g.next_peer, meta, torch.empty(0, self.link.hidden_size, dtype=self.dtype,
                                                                  device=self.device))
                dist.gather_object(self.report(), None, dst=0)
                if meta.get("reset"):
                    self.reset_stats()
                continue
            self.run_step(meta, hidden)


def _die_with_parent(parent: int) -> None:
    """No orphans: if the driver goes away (killed, crashed), so does this worker.

    The driver keeps this process's stdin open for as long as it lives; the kernel closes it
    when the driver's process ends, however it ends, and the read below returns. (Not
    PR_SET_PDEATHSIG: that fires when the *thread* that started the worker exits, and the
    server starts its engine from a loading thread that ends once the model is up.) The
    parent-pid poll covers a driver that handed its end of the pipe to a forked child.
    """

    def watch_pipe():  # the raw descriptor: a thread blocked in sys.stdin's buffered reader
        while os.read(0, 65536):  # would hold its lock and abort the interpreter's shutdown
            pass
        os._exit(1)

    def watch_pid():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch_pipe, daemon=True).start()
    threading.Thread(target=watch_pid, daemon=True).start()


def serve(config, grid: ParallelGrid, init_method: str, model_path, dtype, device) -> None:
    """A worker rank's whole life: join the groups, build the shard, loop, leave."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives (object ones too) run on the current device
    tp_group = init_groups(grid, device, init_method)
    try:
        worker = Worker(config, grid, tp_group, model_path, dtype, device)
        box = [None]
        dist.broadcast_object_list(box, src=0)  # the driver's num_blocks (None: it failed)
        if box[0] is None:
            return
        worker.init_kv_cache(box[0])
        worker.loop()
    finally:
        try:
            destroy_groups()
        except Exception:  # the driver may have gone first; nothing is left to release
            pass


def main() -> None:
    """Entry point of a spawned worker: its arguments arrive pickled on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    args = pickle.load(sys.stdin.buffer)
    _die_with_parent(args["parent"])
    torch.set_num_threads(args["threads"])
    try:
        serve(args["config"], ParallelGrid(args["tp"], args["pp"], args["rank"]), args["init_method"],
              args["model_path"], args["dtype"], torch.device(args["device"]))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
