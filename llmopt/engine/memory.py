"""Does the KV block pool fit in the machine? Asked before a byte of it is allocated.

The pool's size comes from `num_kv_blocks` or a memory budget, and either can ask for more
than there is. Building it first would take minutes and all the RAM before anything failed
(RAM a CPU shares with everything else on it), so the engine compares the pool's bytes with
the memory available now and refuses up front, with the numbers.
"""

from __future__ import annotations

import os

import torch

from llmopt.engine.block_manager import HOST_BYTES_PER_BLOCK


def host_available_bytes() -> int | None:
    """RAM that can be allocated now without swapping: Linux's MemAvailable (page cache that can
    be dropped included), else the free pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform (macOS, Windows)
        return None


def check_kv_pool_fits(num_blocks: int, bytes_per_block: int, device: torch.device) -> None:
    """ValueError naming num_kv_blocks, the bytes needed and the bytes available, if the pool (on
    `device`) plus the block manager's per-block arrays (in RAM) cannot be allocated now."""
    host = num_blocks * HOST_BYTES_PER_BLOCK
    pool = num_blocks * bytes_per_block
    if device.type == "cuda":
        checks = [(pool, torch.cuda.mem_get_info(device)[0], f"free on {device}"), (host, host_available_bytes(), "RAM")]
    else:
        checks = [(pool + host, host_available_bytes(), "RAM")]
    for need, available, where in checks:
        if available is not None and need > available:
            raise ValueError(
                f"num_kv_blocks={num_blocks:,} needs {need:,} bytes ({need / 2**30:,.2f} GiB, {bytes_per_block:,} "
                f"a block) but {available:,} bytes ({available / 2**30:,.2f} GiB) of {where} are available; lower "
                "num_kv_blocks (or the budget it comes from: gpu_memory_utilization, cpu_kv_cache_space)")
