"""Who is who: ranks, the grid they form, and the process groups they talk over.

`world_size = tensor_parallel_size x pipeline_parallel_size` processes. Rank r sits at
pipeline stage `r // tp` and tensor-parallel rank `r % tp`: the ranks of one stage hold the
same layers, each a slice of every matrix, and all-reduce within their stage's group; rank i
of a stage passes its activations to rank i of the next. Rank 0 is the driver: it schedules,
samples, and computes stage 0's first shard itself, as vLLM's driver worker does.

Collectives go over gloo on the CPU and NCCL on CUDA; on CUDA, small host-side messages (the
step's metadata) still travel over gloo, as vLLM keeps a CPU group next to its device group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A step longer than this (or a peer that vanished without closing its sockets) ends the wait
# with an error instead of a hang.
TIMEOUT = timedelta(seconds=float(os.environ.get("LLMOPT_DIST_TIMEOUT", "300")))


@dataclass(frozen=True)
class ParallelGrid:
    tp: int   # tensor_parallel_size
    pp: int   # pipeline_parallel_size
    rank: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    @property
    def next_peer(self) -> int:
        """Same TP rank, next stage."""
        return self.rank + self.tp

    @property
    def prev_peer(self) -> int:
        return self.rank - self.tp


def backend_for(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    """torchrun (torch.distributed.run) sets these in every process it starts."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_groups(grid: ParallelGrid, device: torch.device, init_method: str):
    """Join the world and build one TP group per stage (every rank creates every group, in
    the same order: torch.distributed requires it). Returns this rank's TP group."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process, and not by an llmopt "
                           "LLM (a previous parallel LLM is closed for you): the workers need the default "
                           "group; call torch.distributed.destroy_process_group() first")
    dist.init_process_group(backend_for(device), init_method=init_method, rank=grid.rank,
                            world_size=grid.world_size, timeout=TIMEOUT)
    mine = None
    for stage in range(grid.pp):
        group = dist.new_group(grid.stage_ranks(stage), timeout=TIMEOUT)
        if stage == grid.pp_rank:
            mine = group
    return mine


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
