"""How large the KV block pool is, and does it fit in the machine? Asked before a byte of it
is allocated.

The pool's size comes from `num_kv_blocks` or a memory budget, and either can ask for more
than there is. Building it first would take minutes and all the RAM before anything failed
(RAM a CPU shares with everything else on it), so the engine compares the pool's bytes with
the memory available now and refuses up front, with the numbers.
"""

from __future__ import annotations


import torch

from llmopt.engine.block_manager import HOST_BYTES_PER_BLOCK
from llmopt.model.loader import trim_heap
from llmopt.model.memory import available_bytes, host_available_bytes


def check_kv_pool_fits(num_blocks: int, bytes_per_block: int, device: torch.device) -> None:
    """ValueError naming num_kv_blocks, the bytes needed and the bytes available, if the pool (on
    `device`) plus the block manager's per-block arrays (in RAM) cannot be allocated now."""
    host = num_blocks * HOST_BYTES_PER_BLOCK
    pool = num_blocks * bytes_per_block
    if device.type == "cuda":
        checks = [(pool, available_bytes(device), f"free on {device}"), (host, host_available_bytes(), "RAM")]
    else:
        checks = [(pool + host, host_available_bytes(), "RAM")]
    for need, available, where in checks:
        if available is not None and need > available:
            raise ValueError(
                f"num_kv_blocks={num_blocks:,} needs {need:,} bytes ({need / 2**30:,.2f} GiB, {bytes_per_block:,} "
                f"a block) but {available:,} bytes ({available / 2**30:,.2f} GiB) of {where} are available; lower "
                "num_kv_blocks (or the budget it comes from: gpu_memory_utilization, cpu_kv_cache_space)")


def kv_blocks_from_budget(config, model, device: torch.device, max_model_len: int, bytes_per_block: int) -> int:
    """What is left of the budget after the weights, in blocks (vLLM's profiling, simplified).

    CUDA: `gpu_memory_utilization` x device memory, minus this engine's weights and the
    activation peak of a profile forward (the largest step) and minus what lives outside torch
    (the CUDA context, other processes), and never more than is free: like vLLM's, the fraction
    is this engine's share, so two engines at 0.4 fit in one process and another engine's pool is
    not counted as this one's weights. CPU: `cpu_kv_cache_space` GiB (vLLM reads
    VLLM_CPU_KVCACHE_SPACE) when given; else sized here, since a CPU's RAM is shared with
    everything else (the notebook, a reference model, the OS): a quarter of the memory
    available once the weights are loaded, at least 0.25 GiB and at most 4 GiB, and never
    more than the running batch can fill (max_num_seqs sequences of max_model_len tokens).
    4 GiB holds 93K tokens of SmolLM2-135M in float32, more than a few CPU cores get through
    in minutes of decoding; a quarter leaves Binder's 2 GiB machines room for the rest.
    """
    if device.type == "cuda":
        activations = profile_peak_memory(model, device, config.max_num_batched_tokens, config.max_num_seqs,
                                          max_model_len)
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if t.is_cuda)
        free, total = torch.cuda.mem_get_info(device)
        other = total - free - torch.cuda.memory_reserved(device)  # other processes, CUDA context
        budget = min(config.gpu_memory_utilization * total - weights - activations - max(0, other),
                     free - activations)
    elif config.cpu_kv_cache_space is not None:
        budget = config.cpu_kv_cache_space * 2**30
    else:
        block_size = config.block_size
        fill = config.max_num_seqs * max_model_len / block_size * bytes_per_block
        budget = min(max((host_available_bytes() or 2**30) / 4, 0.25 * 2**30), 4 * 2**30, fill)
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError("no memory is left for the KV cache after loading the weights; raise "
                         "gpu_memory_utilization / cpu_kv_cache_space or set num_kv_blocks")
    return blocks


@torch.inference_mode()
def profile_peak_memory(model, device: torch.device, num_tokens: int, max_num_seqs: int,
                        max_model_len: int) -> int:
    """Peak bytes torch needs for the largest step's activations, above what is allocated now
    (the weights, other engines): one dummy forward of `num_tokens` (max_num_batched_tokens), as
    vLLM's profile run does."""
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.model.forward import run_model
    from llmopt.worker.kv_cache import NoKVCache

    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    n = num_tokens
    lens = [min(n, max_model_len - 1)] * (n // (max_model_len - 1))
    lens += [n - sum(lens)] if n - sum(lens) > 0 else []
    ids = torch.zeros(n, dtype=torch.long, device=device)
    hidden = run_model(model, NoKVCache(), ids, AttentionMetadata.uncached(lens, device))
    model.compute_logits(hidden[-max_num_seqs:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden
    torch.cuda.empty_cache()
    return peak


class HostMemoryRelease:
    """Made, and again dropped, it hands the heap pages freed so far back to the OS. glibc keeps
    them mapped (its mmap threshold rises to the size of freed weights, so the next weights land on
    the heap), and a process's RSS stayed at its peak after `del llm`; malloc_trim returns them.
    The engine makes one last, when loading has freed the weights' first copies and temporaries,
    and holds it as its last attribute, so that it goes after the weights and the KV pool."""

    def __init__(self):
        trim_heap()

    def __del__(self):
        try:
            trim_heap()
        except Exception:  # noqa: BLE001 - at interpreter exit ctypes may be gone; nothing is left to give back
            pass
