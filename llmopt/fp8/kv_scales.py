"""Where an FP8 pool's scales come from besides calibration (llmopt/worker/kv_cache.py measures
those): a checkpoint's per-layer k/v scales, and the sample text calibration runs over.
"""

from __future__ import annotations

import re
from pathlib import Path


def calibration_token_ids(tokenizer, num_tokens: int = 4096, seq_len: int = 512) -> list[list[int]]:
    """`num_tokens` tokens of the bundled held-out text's calibration part (never the part
    that evaluation scores), cut into sequences of `seq_len`."""
    from llmopt.model.registry import heldout_text

    ids = tokenizer(heldout_text("calibration"), add_special_tokens=False,
                    verbose=False)["input_ids"][:num_tokens]
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]


# Checkpoint names for per-layer KV scales, as vLLM reads them: llm-compressor's
# `self_attn.k_scale` (older: `k_proj.output_scale`), ModelOpt's `k_proj.k_scale`, and the
# deprecated single `kv_scale` (used for both).
_KV_SCALE_NAME = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_scale|(k|v)_proj\.(?:output_scale|(?:k|v)_scale)|(kv)_scale)$")


def read_kv_scales(folder: str | Path, num_layers: int) -> tuple[list[float], list[float]] | None:
    """Per-layer (k_scales, v_scales) from a checkpoint's safetensors, or None if it has none.

    ValueError if only some layers have them, or a scale is not a positive finite number.
    """
    from safetensors import safe_open

    from llmopt.model.gguf import is_gguf
    from llmopt.model.loader import safetensors_files

    if is_gguf(folder):
        return None  # llama.cpp's format stores no KV-cache scales
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for f in safetensors_files(Path(folder)):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                m = _KV_SCALE_NAME.search(name)
                if m is None:
                    continue
                layer, which = int(m.group(1)), m.group(2) or m.group(3) or m.group(4)
                t = handle.get_tensor(name).float()
                if t.numel() != 1:
                    raise ValueError(f"{f}: {name} has shape {tuple(t.shape)}; a per-tensor KV scale "
                                     "has one element")
                value = t.item()
                if not (0 < value < float("inf")):
                    raise ValueError(f"{f}: {name} = {value}; a KV scale must be a positive finite number")
                for kv in ("k", "v") if which == "kv" else (which,):
                    found[kv].setdefault(layer, value)
    if not found["k"] and not found["v"]:
        return None
    for kv in ("k", "v"):
        missing = sorted(set(range(num_layers)) - set(found[kv]))
        if missing:
            raise ValueError(f"{folder}: the checkpoint has KV scales, but no {kv}_scale for layers "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return [found["k"][i] for i in range(num_layers)], [found["v"][i] for i in range(num_layers)]
