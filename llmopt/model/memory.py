"""How much memory an allocation can take now: asked before building anything large (a KV pool,
a model's random weights), so that a request too big for the machine is refused with the numbers
instead of ending the process."""

from __future__ import annotations

import os

import torch


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


def available_bytes(device: torch.device) -> int | None:
    """Free memory on `device`: the GPU's, or the host's RAM (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()
