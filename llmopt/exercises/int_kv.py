"""Lesson 14's exercise: KIVI's per-channel int4 keys, one block of the KV pool at a time.

Keys have a few large channels, the same ones at every token, so an int4 pool groups them per
channel: every key channel of a KV head shares one float16 scale s and minimum m over a block's
tokens, and each number is stored as a 4-bit code q = clamp(round((x - m) / s), 0, 15), read back
as q * s + m. The learner quantizes one whole block of keys; the check holds the codes and the
groups against what the engine's own write (`write_int_kv`, the torch twin of the C++ kernel)
stores for that block; the live run makes the engine store every whole block of keys it writes
with the learner's function and generates beside the engine's own int4 pool.
"""

from __future__ import annotations

import torch

from llmopt.exercises.base import Case, Exercise
from llmopt.kernels.int_kv_ref import pack, scale_shapes, unpack, write_int_kv


def quantize_keys_solution(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of keys k [block_size, num_kv_heads, head_dim] (float32) as int4 codes per
    channel: (codes uint8 [block_size, num_kv_heads, head_dim], each 0..15; groups float16
    [num_kv_heads, head_dim, 2], each channel's (scale, minimum))."""
    lo, hi = k.amin(0), k.amax(0)                              # per channel, over the block's tokens
    group = torch.stack(((hi - lo) / 15, lo), -1).half()       # stored as float16 ...
    s, m = group[..., 0].float(), group[..., 1].float()        # ... so codes are taken on the rounded grid
    q = torch.round((k - m) / torch.where(s > 0, s, 1.0)).clamp(0, 15)
    q = torch.where(s > 0, q, 0.0)                             # a constant channel: every code 0, read back m
    return q.to(torch.uint8), group


def engine_block(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine stores for k [block_size, H, D] written whole into an empty int4 block."""
    bs, H, D = k.shape
    (ks, kd), (vs, vd) = scale_shapes(1, bs, H, D, 4)
    k_pool, v_pool = torch.zeros(1, bs, H, D // 2, dtype=torch.uint8), torch.zeros(1, bs, H, D // 2, dtype=torch.uint8)
    k_scales, v_scales = torch.zeros(ks, dtype=kd), torch.zeros(vs, dtype=vd)
    write_int_kv(k, torch.zeros_like(k), k_pool, v_pool, k_scales, v_scales, torch.arange(bs), 4)
    return unpack(k_pool[0], 4), k_scales[0]


def _keys(seed: int, shape: tuple[int, int, int], kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g)
    if kind == "outlier channels":    # KIVI's observation: a few channels large at every token
        k[:, :, 5] = k[:, :, 5] * 0.3 + 12.0
        k[:, 0, 17] = k[:, 0, 17] * 0.5 - 9.0
    elif kind == "a constant channel":  # max == min: scale 0, every code 0
        k[:, 1, 3] = 0.75
    elif kind == "one token far out":   # one token stretches each channel's range
        k[4] *= 20.0
    elif kind == "wide range":          # scale and minimum far from 1: their float16 rounding shows
        k = k * 300.0 + 1000.0
    return k


# (seed, [block_size, num_kv_heads, head_dim], kind): SmolLM2's and tiny's shapes among them
CASES = [(0, (16, 2, 64), "plain"), (1, (16, 3, 64), "outlier channels"), (2, (8, 2, 64), "a constant channel"),
         (3, (16, 1, 128), "one token far out"), (4, (16, 3, 64), "wide range"), (5, (1, 2, 64), "one token"),
         (6, (32, 2, 64), "outlier channels")]


def cases():
    for seed, shape, kind in CASES:
        k = _keys(seed, shape, kind)
        codes, group = engine_block(k)
        yield Case({"k": k}, [codes, group], lambda fn, k=k: list(fn(k.clone())), note=kind)


def live(fn, model: str = "smollm2") -> str:
    """`model` on an int4 KV pool (eager, so the step writes through `write_int_kv`), every block of
    keys a step writes whole (a prompt's full blocks) stored as `fn` quantizes it, over the
    engine's own codes; greedy tokens beside the engine's own int4 pool and its float pool."""
    from llmopt import LLM, SamplingParams
    from llmopt.worker import kv_cache

    engine_write, written = kv_cache.write_int_kv, []

    def write_with_yours(k, v, k_pool, v_pool, k_scales, v_scales, slot_mapping, bits):
        engine_write(k, v, k_pool, v_pool, k_scales, v_scales, slot_mapping, bits)
        bs = k_pool.shape[1]
        slots = slot_mapping.long()
        for block in torch.unique(slots // bs).tolist():
            rows = (slots // bs == block).nonzero().flatten()
            if bits != 4 or len(rows) != bs:
                continue   # a block the step fills only in part: the engine's own (its groups grow)
            order = rows[torch.argsort(slots[rows] % bs)]
            codes, group = fn(k[order].float())
            k_pool[block] = pack(codes.to(torch.uint8), 4)
            k_scales[block] = group.to(torch.float16)
            written.append(block)

    prompt = ("Keys and values of every token a model has read are kept in a pool of blocks. "
              "Stored in four bits, a block of keys holds each channel's minimum and scale. ") * 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = {}
    for dtype in ("auto", "int4"):
        llm = LLM(model, device="cpu", kv_cache_dtype=dtype, block_size=16, enforce_eager=True,
                  enable_prefix_caching=False)
        runs = [("float pool", False)] if dtype == "auto" else [("engine's int4", False), ("your int4 keys", True)]
        for name, plugged in runs:
            kv_cache.write_int_kv = write_with_yours if plugged else engine_write
            try:
                texts[name] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            finally:
                kv_cache.write_int_kv = engine_write
        del llm
    yours, engine, plain = (list(texts[n].token_ids) for n in ("your int4 keys", "engine's int4", "float pool"))
    lines = [f"{model}, greedy, {params.max_tokens} tokens; blocks of keys your function quantized: {len(written)}"]
    lines += [f"{name + ':':16}{out.text!r}" for name, out in texts.items()]
    lines += [("your keys give the engine's own int4 tokens" if yours == engine
               else "DIFFERENT: your keys change the tokens the int4 engine generates"),
              "(the engine's int4 pool " + ("gives the float pool's tokens)" if engine == plain
                                            else "generates other tokens than the float pool)")]
    return "\n".join(lines)


EXERCISE = Exercise("int4_keys_per_channel", 14,
                    "quantize a block of keys to int4 per channel, KIVI's grouping, with float16 scale and minimum",
                    cases, quantize_keys_solution, live)
