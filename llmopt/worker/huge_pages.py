"""Weights on 2 MB pages: the decode step's reads without a page walk every 4 KB.

A decode step reads every weight once, front to back, and on a CPU each 4 KB page of them is
one entry of the TLB, the core's cache of address translations. SmolLM2's Q4_1 weights are
24,000 such pages against an L2 TLB of 2-3 thousand entries, so every page of every step is a
miss and a page-table walk, and the hardware prefetcher, which stops at page boundaries, has
to start again behind it. On 2 MB pages (Linux's transparent huge pages, asked for with
madvise) the same weights are 48 pages, and a SmolLM2 step's matmuls, its head and batch-1
decode all ran faster on them than on 4 KB pages, in Q4_1 blocks and in dense bf16 alike
(measured: benchmarks/README.md, "Measurements behind the code's choices").
(The KV pools on huge pages measured the same as on 4 KB pages, so they stay as they are.)

`move_weights(model)` copies every parameter and buffer of at least a page, and the blocks and
scales of GGUF layers, into one such mapping and points the model at the copies. The values are
the same numbers, so every output is bit for bit what it was. Where the OS grants no huge pages
(another OS, or transparent huge pages set to "never") it does nothing.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from llmopt.model.loader import trim_heap

HUGE_PAGE = 2 << 20
MIN_BYTES = 4096      # a tensor smaller than a page (a norm's weights) stays where it is
ALIGN = 64            # each tensor starts on a cache line
TRIM_EVERY = 64 << 20  # bytes moved between giving the old copies' pages back


def available() -> bool:
    """Transparent huge pages may be asked for here (Linux, not set to "never")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], anonymous memory on 2 MB pages where the kernel grants them; it starts on a
    2 MB boundary (the mapping is taken 2 MB larger, since only whole aligned 2 MB spans become
    huge pages). Pages are touched, and so cost memory, only as they are written."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while a view lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _gguf_blocks(model: torch.nn.Module):
    for module in model.modules():
        blocks = getattr(module, "weight_blocks", None)
        if blocks is not None:
            yield blocks


def move_weights(model: torch.nn.Module) -> int:
    """Move a CPU model's large weights onto huge pages; returns the bytes moved (0 where none)."""
    if not available():
        return 0
    slots = []  # (tensor, how to point its owner at its copy)
    seen: set[int] = set()

    def want(t, rebind):
        if (t is not None and t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= MIN_BYTES
                and t.data_ptr() not in seen):
            seen.add(t.data_ptr())
            slots.append((t, rebind))

    for p in model.parameters():  # a tied embedding and head are one Parameter: moved once
        want(p, lambda new, p=p: setattr(p, "data", new))
    for module in model.modules():
        for name, b in module._buffers.items():
            want(b, lambda new, m=module, n=name: m._buffers.__setitem__(n, new))
    for blocks in _gguf_blocks(model):
        for name in ("qs", "d", "m"):
            want(getattr(blocks, name), lambda new, o=blocks, n=name: setattr(o, n, new))
    if not slots:
        return 0
    # Each tensor is pointed at its copy as soon as it is made, and the heap trimmed every
    # TRIM_EVERY bytes, so the old copies go back to the OS on the way: copying all first held
    # the weights twice at once (SmolLM2 in float32: 0.5 GB more at the peak).
    arena, offsets = _arena([t for t, _ in slots])
    moved = since_trim = 0
    with torch.no_grad():
        while slots:
            t, rebind = slots.pop(0)
            new = arena[offsets.pop(0):][:t.nbytes].view(t.dtype).view(t.shape)
            new.copy_(t)
            rebind(new)
            moved, since_trim = moved + t.nbytes, since_trim + t.nbytes
            del t
            if since_trim >= TRIM_EVERY:
                trim_heap()
                since_trim = 0
    trim_heap()
    return moved


def onto_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same tensors, those of at least a page copied into one mapping on 2 MB pages (the
    compiled step's own repacked weights, which `move_weights` never saw); as they are where the
    OS grants no huge pages."""
    big = [i for i, t in enumerate(tensors)
           if t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= MIN_BYTES]
    if not big or not available():
        return list(tensors)
    out = list(tensors)
    for i, new in zip(big, _arena_copies([tensors[i] for i in big])):
        out[i] = new
    return out


def _arena(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One huge-page mapping with room for `tensors` side by side (each on a cache line), and
    where each one goes in it."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    return huge_page_buffer(total), offsets


def _arena_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` side by side in one huge-page mapping."""
    arena, offsets = _arena(tensors)
    copies = []
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            new = arena[off:off + t.nbytes].view(t.dtype).view(t.shape)
            new.copy_(t)
            copies.append(new)
    return copies
