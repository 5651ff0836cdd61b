"""Split-K: enough programs for a GPU when a product has one row.

A weight-only matmul at decode batch sizes is a matrix-vector product: with one program per tile
of 64 output columns, an 8192-wide layer runs 128 programs, each walking all 8192 inputs in
sequence, on a GPU with 132 streaming multiprocessors that each want several programs in flight
to hide memory latency. Splitting K gives each program a slice of the inputs and multiplies the
programs by the split; the slices' partial sums (float32, [split, M, N]) are added in a fixed
order afterwards, so the result does not depend on which program finished first (an atomic add
would make it vary from run to run).
"""

from __future__ import annotations

import functools

import torch

TARGET_WAVES = 2      # programs per multiprocessor to aim for
MIN_TILES_PER_SPLIT = 4  # each program still walks at least this many K tiles


def split_k(M: int, N: int, K: int, block_n: int, block_k: int, device, max_rows: int = 16) -> int:
    """How many slices of K a product of M rows takes: 1 above `max_rows` rows (enough row tiles
    already) or where the output tiles alone fill the GPU; else a power of two up to that."""
    if M > max_rows:
        return 1
    tiles, split, sms = -(-N // block_n), 1, multiprocessors(torch.device(device))
    while tiles * split < TARGET_WAVES * sms and K // (2 * split) >= MIN_TILES_PER_SPLIT * block_k:
        split *= 2
    return split


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors, asked once per device (split_k runs on every product);
    the interpreter (tests) gets a small machine, so that small shapes exercise the split too."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def k_per_split(K: int, split: int, block_k: int) -> int:
    """Inputs per slice, a multiple of block_k (the last slice may be shorter)."""
    return -(-(-(-K // split)) // block_k) * block_k


def reduce_partials(partial: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """[split, M, N] float32 partial sums -> [M, N] in `dtype`, times a per-column `scale`, plus `bias`."""
    out = partial.sum(0)
    if scale is not None:
        out = out * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)
