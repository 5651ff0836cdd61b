"""Random weights of a real model's shape: `LLM(model="llama-3.2-1b", load_format="dummy")`.

vLLM's `load_format="dummy"` answers a question a learner cannot otherwise ask on a laptop
without downloading gigabytes: how fast does *this shape* run here? A decode step's time is
set by the bytes it reads and the arithmetic it does, and both depend on the sizes in
config.json, never on the values of the weights. So the model is built from its config on
the meta device (no memory), allocated once directly in the dtype it will run in (an 8B shape
in float32 would need 32 GB before any cast), and filled with random numbers of a trained
model's scale: normal with standard deviation 0.02 (the `initializer_range` of all four
shipped configs) for the matrices and the embedding, ones for the norms' gains, zeros for
biases. Activations then stay finite through every layer, as real ones do, so the kernels run
the code paths they run for real weights.

What such a model says is noise: perplexity, chat and text prompts are refused by the engine
(`refuse_text`), so no number about quality can come from it.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.model.memory import available_bytes

DEFAULT_STD = 0.02


def weight_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes the model's parameters take in `dtype` (a tied embedding counted once); works on meta."""
    seen, total = set(), 0
    for p in model.parameters():  # parameters() skips a shared (tied) tensor's second name
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
    return total


def check_fits(model: nn.Module, dtype: torch.dtype, device: torch.device, name: str) -> None:
    """ValueError before any allocation when the weights alone would not fit in memory."""
    need, free = weight_bytes(model, dtype), available_bytes(device)
    if free is not None and need > 0.9 * free:
        smaller = "" if dtype.itemsize <= 2 else " dtype='bfloat16' halves it;"
        raise ValueError(f"{name} with random weights in {str(dtype).removeprefix('torch.')} needs "
                         f"{need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB of {device.type} memory is "
                         f"available;{smaller} a GGUF file of it (`llmopt quantize --method gguf "
                         f"--load-format dummy --qtype Q4_0`) needs about a quarter of bfloat16's bytes")


# Drawing a billion normal numbers one by one takes torch's CPU generator ~10 s (it runs on one
# thread); copying is ~50x faster. So one pool of POOL draws is laid end to end over each tensor from
# a random start. POOL is prime: a row of any width starts at a different place in the pool than the
# rows before it (the first repeat comes after POOL rows), so no two rows of a matrix are equal and
# no output of a matmul copies another.
POOL = 1_048_583


@torch.no_grad()
def fill_random(model: nn.Module, std: float | None = None, seed: int = 0) -> None:
    """Norm gains 1, biases 0, every other parameter normal(0, std) draws in its own dtype."""
    std = DEFAULT_STD if std is None else std
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * POOL, generator=gen) * std   # twice over: any start has POOL values after it
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.is_floating_point():
            continue
        seen.add(id(p))
        if "norm" in name.rsplit(".", 2)[-2]:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            start = int(torch.randint(POOL, (1,), generator=gen))
            tile_over(p.view(-1), pool[start:start + POOL].to(device=device, dtype=p.dtype))


def tile_over(flat: torch.Tensor, pool: torch.Tensor) -> None:
    """flat[i] = pool[i % len(pool)], in one copy for the whole periods and one for the rest."""
    n, period = flat.numel(), pool.numel()
    whole = n // period
    if whole:
        flat[:whole * period].view(whole, period).copy_(pool.expand(whole, period))
    flat[whole * period:].copy_(pool[:n - whole * period])


def dummy_model(cfg, folder, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The decoder of `cfg`, allocated in `dtype` on `device` and filled with random weights."""
    from llmopt.model.build import meta_model, tie_and_rotate, trim_heap

    if cfg.quantization_config is not None:   # (quantizing on load, quantization='int8' / 'fp8', works)
        raise ValueError(f"{folder}: load_format='dummy' makes dense random weights, but this config.json "
                         f"names a quantized checkpoint ({cfg.quantization_config.get('quant_method')!r})")
    model = meta_model(cfg, dtype)
    check_fits(model, dtype, device, folder.name)
    model = model.to_empty(device=device)
    tie_and_rotate(model, cfg, device)
    fill_random(model, seed=seed)
    trim_heap()
    return model.eval()


def refuse_text(what: str, model: str) -> ValueError:
    """The one error for anything that would read meaning into random weights."""
    return ValueError(f"{what} is refused: {model!r} was loaded with load_format='dummy', random weights "
                      "of its shape, so any text it reads or writes and any perplexity are noise. It is "
                      "for speed: give prompts as {'prompt_token_ids': [...]} and read the token ids")
