"""The tiers below the KV pool: where the blocks a prefix cache evicts wait for their next hit.

A tier is an array of slots, each the size of one pool block: every layer's keys and values (and
an int pool's groups), the bytes the pool holds, laid end to end. `BlockBytes` copies blocks
between the pool and such flat rows; a tier stores and returns the rows.

- `HostTier`: host memory (on a GPU the pool's first tier below: pinned, so copies run at PCIe
  speed; vLLM's native offloading and SGLang's HiCache keep it there).
- `DiskTier`: a file (on the CPU, where the pool already is host memory, the tier below it). It
  is read and written with pread / pwrite rather than memory-mapped: a mapped file that is
  truncated under the engine turns the next touch of a lost page into SIGBUS, which would stop
  the engine for every request; a short read is an answer the engine can act on (recompute).
  Unwritten slots cost nothing: the file is sparse, and the OS's page cache keeps hot slots in
  RAM, so a hit on a recent block is a memory copy.

A row's CRC-32 is taken when it is written and kept beside the tier's index
(llmopt/engine/kv_offload.py), which checks it on every read: bytes changed on disk, or a
file cut short, are never used.
"""

from __future__ import annotations

import os
import tempfile
import weakref
import zlib

import torch

GiB = 1 << 30


def pool_tensors(kv_cache) -> list[torch.Tensor]:
    """Every tensor of a paged pool indexed by block along dim 0: keys, values, int groups (MLA:
    the latent rows)."""
    if hasattr(kv_cache, "kv"):
        return list(kv_cache.kv)
    return kv_cache.k + kv_cache.v + (kv_cache.k_scales or []) + (kv_cache.v_scales or [])


class BlockBytes:
    """Pool blocks <-> rows of bytes: row i = block i's tensors in `pool_tensors` order."""

    def __init__(self, kv_cache):
        self.tensors = pool_tensors(kv_cache)
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.nbytes = sum(self.sizes)

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), nbytes] uint8 on the host: the blocks' bytes."""
        out = torch.empty((len(blocks), self.nbytes), dtype=torch.uint8)
        idx = torch.tensor(blocks, device=self.tensors[0].device)
        at = 0
        for t, n in zip(self.tensors, self.sizes):  # one copy per pool tensor, however many blocks
            out[:, at:at + n].copy_(t[idx].reshape(len(blocks), -1).view(torch.uint8))
            at += n
        return out

    def scatter(self, blocks: list[int], rows: torch.Tensor) -> None:
        """Blocks take the rows' bytes (the inverse of `gather`)."""
        idx = torch.tensor(blocks, device=self.tensors[0].device)
        at = 0
        for t, n in zip(self.tensors, self.sizes):
            part = rows[:, at:at + n].contiguous().view(t.dtype).reshape((len(blocks),) + t.shape[1:])
            t[idx] = part.to(t.device)
            at += n


def checksum(row: torch.Tensor) -> int:
    return zlib.crc32(row.numpy())


class HostTier:
    """`num_slots` rows of `nbytes` in host memory."""

    kind = "cpu"

    def __init__(self, num_slots: int, nbytes: int, pin: bool = False):
        self.num_slots, self.nbytes = num_slots, nbytes
        self.rows = torch.empty((num_slots, nbytes), dtype=torch.uint8, pin_memory=pin)

    def write(self, slot: int, row: torch.Tensor) -> None:
        self.rows[slot].copy_(row)

    def read(self, slot: int, out: torch.Tensor) -> bool:
        out.copy_(self.rows[slot])
        return True

    def close(self) -> None:
        self.rows = None


class DiskTier:
    """`num_slots` rows of `nbytes` in a file in `folder` (a temporary folder when None), created
    sparse and removed when the tier is closed or collected."""

    kind = "disk"

    def __init__(self, num_slots: int, nbytes: int, folder: str | None = None):
        self.num_slots, self.nbytes = num_slots, nbytes
        if folder is not None and not os.path.isdir(folder):
            raise ValueError(f"kv_offloading_path must be an existing folder (the disk tier's file goes "
                             f"there), got {folder!r}")
        fd, self.path = tempfile.mkstemp(prefix="llmopt-kv-", suffix=".tier", dir=folder)
        self.fd = fd
        os.ftruncate(fd, num_slots * nbytes)  # sparse: disk is used only as slots are written
        self._finalizer = weakref.finalize(self, _remove, fd, self.path)

    def write(self, slot: int, row: torch.Tensor) -> None:
        os.pwrite(self.fd, row.numpy(), slot * self.nbytes)

    def read(self, slot: int, out: torch.Tensor) -> bool:
        """False when the file no longer holds the whole row (cut short)."""
        return os.preadv(self.fd, [out.numpy()], slot * self.nbytes) == self.nbytes

    def close(self) -> None:
        self._finalizer()


def _remove(fd: int, path: str) -> None:
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def build_tiers(size_gib: float, nbytes: int, device: torch.device, folder: str | None) -> list:
    """The tiers below a pool, fastest first, `size_gib` each: on a GPU host memory (pinned), then a
    file in `folder` if one is named; on the CPU, whose pool is host memory already, the file."""
    num_slots = int(size_gib * GiB) // nbytes
    if num_slots < 1:
        raise ValueError(f"kv_offloading_size={size_gib} GiB holds no KV block of this model "
                         f"({nbytes} bytes a block); allowed: at least {nbytes / GiB:.6f} GiB")
    if device.type == "cuda":
        tiers = [HostTier(num_slots, nbytes, pin=True)]
        return tiers + ([DiskTier(num_slots, nbytes, folder)] if folder is not None else [])
    return [DiskTier(num_slots, nbytes, folder)]
