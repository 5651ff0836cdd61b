"""`quantize(model, method, bits, group_size, out=...)`: one call from a full-precision model
to a quantized checkpoint that `LLM(model=out)` (and AutoGPTQ, AutoAWQ, vLLM) can load.

    quantize("tiny", method="gptq", bits=4, group_size=128, out="q/tiny-gptq")

Every argument is checked before any weight is loaded. The knobs keep the names the
tools use: GPTQ's desc_act, damp_percent, sym, static_groups, true_sequential, mse; AWQ's
zero_point, version="GEMM", duo_scaling and apply_clip (AutoAWQ's defaults: both on). Methods:

- "rtn": round to nearest, group-wise (the baseline; no calibration);
- "gptq": GPTQ with calibration, block by block (llmopt.quant.gptq);
- "awq": activation-aware scaling and clipping, then rounding (llmopt.quant.awq);
- "fp8": float8 e4m3 weights with per-output-channel scales (no calibration; where FP8
  units multiply, activations are quantized per token at run time);
- "nf4": QLoRA's 4-bit NormalFloat in blocks of `group_size` (64), `double_quant` (default on)
  for the absmax constants, written in the bitsandbytes layout (llmopt.layers.quant.nf4).

`rotation="hadamard"` (any method) first folds the norms into the linears and rotates the
residual stream and each head's values by Hadamard matrices (llmopt.quant.rotation); the model
computes the same function, its outliers spread out, and a tied head is untied.

Integer weights are written in the GPTQ v1 layout (format="gptq", any of 2/3/4/8 bits) or
the AWQ GEMM layout (format="awq", 4-bit); by default GPTQ and RTN write GPTQ's, AWQ AWQ's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path

import torch

from llmopt.layers.quant.formats import AWQ_BITS, GPTQ_BITS, QuantizedWeight
from llmopt.quant.rotation import ROTATIONS

METHODS = ("rtn", "gptq", "awq", "fp8", "nf4")
FORMATS = ("gptq", "awq")
GPTQ_KNOBS = ("desc_act", "damp_percent", "static_groups", "true_sequential", "mse")
AWQ_KNOBS = ("zero_point", "version", "duo_scaling", "apply_clip")


@dataclass
class QuantizeResult:
    path: Path
    method: str
    bits: int
    group_size: int
    format: str
    seconds: float                 # the quantization itself: calibration passes and the algorithm
    linear_bytes: int              # the linear layers' weights as stored
    fp16_linear_bytes: int         # the same weights in fp16
    num_calibration_tokens: int = 0
    details: dict = field(default_factory=dict)  # per layer: AWQ's chosen scales and errors

    @property
    def linear_bytes_ratio(self) -> float:
        return self.linear_bytes / self.fp16_linear_bytes


def quantize(model="tiny", method: str = "gptq", bits: int | None = None, group_size: int | None = None,
             out=None, *, calibration=None, num_samples: int = 32, seq_len: int = 512,
             sym: bool | None = None, desc_act: bool | None = None, damp_percent: float | None = None,
             static_groups: bool | None = None, true_sequential: bool | None = None, mse: float | None = None,
             zero_point: bool | None = None, version: str | None = None, duo_scaling: bool | None = None,
             apply_clip: bool | None = None, format: str | None = None, rotation: str | None = None,
             double_quant: bool | None = None, block_size: int = 128, device: str = "cpu",
             progress: bool = True) -> QuantizeResult:
    """Quantize a bundled model name or Hugging Face folder and write the checkpoint to `out`."""
    from llmopt.model.config import ModelConfig
    from llmopt.model.registry import resolve_model

    # -- arguments, all checked before any work ---------------------------------------------------------
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    given = {"desc_act": desc_act, "damp_percent": damp_percent, "static_groups": static_groups, "mse": mse,
             "true_sequential": true_sequential, "zero_point": zero_point, "version": version, "sym": sym,
             "duo_scaling": duo_scaling, "apply_clip": apply_clip}
    for knobs, owner in ((GPTQ_KNOBS, "gptq"), (AWQ_KNOBS, "awq")):
        for knob in knobs:
            if given[knob] is not None and method != owner:
                raise ValueError(f"{knob} is an option of method={owner!r}; method={method!r} does not take it")
    if rotation is not None and rotation not in ROTATIONS:
        raise ValueError(f"rotation must be None or one of {', '.join(ROTATIONS)}, got {rotation!r}")
    if double_quant is not None and method != "nf4":
        raise ValueError(f"double_quant is an option of method='nf4'; method={method!r} does not take it")
    if method == "awq" and sym is not None:
        raise ValueError("AWQ spells symmetric quantization zero_point=False (sym is GPTQ's name)")
    if method == "fp8":
        if bits not in (None, 8) or group_size is not None or sym is not None or format is not None:
            raise ValueError("method='fp8' stores e4m3 weights with one scale per output channel; "
                             "it takes no bits (other than 8), group_size, sym or format")
        bits, group_size, layout = 8, -1, "fp8"
    elif method == "nf4":
        if bits not in (None, 4) or sym is not None or format is not None:
            raise ValueError("method='nf4' stores 4-bit NormalFloat codes in the bitsandbytes layout; "
                             "it takes no bits (other than 4), sym or format")
        group_size = 64 if group_size is None else group_size   # bitsandbytes' block size
        if isinstance(group_size, bool) or not isinstance(group_size, Integral) or group_size < 2:
            raise ValueError(f"group_size (NF4's block size) must be an integer >= 2, got {group_size!r}")
        bits, layout = 4, "bitsandbytes"
    else:
        bits = 4 if bits is None else bits
        group_size = 128 if group_size is None else group_size
        layout = format or ("awq" if method == "awq" else "gptq")
        if layout not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        allowed = AWQ_BITS if layout == "awq" else GPTQ_BITS
        if isinstance(bits, bool) or bits not in allowed:
            hint = "; write other widths with format='gptq'" if layout == "awq" else ""
            raise ValueError(f"bits must be one of {allowed} for the {layout.upper()} layout, got {bits!r}{hint}")
        if isinstance(group_size, bool) or not isinstance(group_size, Integral) or not (
                group_size == -1 or group_size > 0):
            raise ValueError(f"group_size must be -1 (one group per output channel) or a positive "
                             f"integer, got {group_size!r}")
        if layout == "awq" and desc_act:
            raise ValueError("act-order (desc_act=True) needs g_idx, which the AWQ layout lacks; use format='gptq'")
    if method in ("rtn", "fp8", "nf4") and calibration is not None:
        raise ValueError(f"method={method!r} uses no calibration data; pass calibration only to gptq or awq")
    for name, value, lo in (("num_samples", num_samples, 1), ("seq_len", seq_len, 2), ("block_size", block_size, 1)):
        if isinstance(value, bool) or not isinstance(value, Integral) or value < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    damp = 0.01 if damp_percent is None else damp_percent
    if isinstance(damp, bool) or not isinstance(damp, Real) or not 0 < damp < 1:
        raise ValueError(f"damp_percent must be in (0, 1), got {damp_percent!r}")
    if mse is not None and (isinstance(mse, bool) or not isinstance(mse, Real) or not 0 <= mse <= 10):
        raise ValueError(f"mse (the error norm of GPTQ's grid-range search; 0 = off, 2.4 = the authors') must "
                         f"be a number in [0, 10], got {mse!r}")
    if version is not None and str(version).lower() != "gemm":
        raise ValueError(f"version must be 'GEMM' (the AWQ layout llmopt writes), got {version!r}")
    if str(device) != "cpu" and not str(device).startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if out is None or not isinstance(out, (str, Path)) or str(out) == "":
        raise ValueError("out must name the folder to write the quantized checkpoint to")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / "config.json").is_file()):
        raise ValueError(f"out={str(out)!r} exists and is not an empty folder or an earlier checkpoint")

    folder = resolve_model(model)
    cfg = ModelConfig.from_pretrained(folder)
    if cfg.quantization_config is not None:
        raise ValueError(f"{folder} is already quantized "
                         f"({cfg.quantization_config.get('quant_method')!r}); start from full precision")
    if method in ("gptq", "awq") and seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})")
    in_features = {"q/k/v and gate/up": cfg.hidden_size, "o_proj": cfg.num_attention_heads * cfg.head_dim,
                   "down_proj": cfg.intermediate_size}
    for where, k in in_features.items():
        if group_size != -1 and k % group_size:
            raise ValueError(f"group_size={group_size} does not divide the in_features of {where} ({k}); "
                             f"pick a divisor of {k} or -1")
        if layout not in ("fp8", "bitsandbytes") and (k * bits) % 32:
            raise ValueError(f"{bits}-bit weights of {where} ({k} inputs) do not fill whole int32 words")

    # -- calibration, model, algorithm -------------------------------------------------------------------
    from llmopt.model.loader import load_model

    windows = None
    if method in ("gptq", "awq"):
        windows = calibration_windows_for(folder, calibration, num_samples, seq_len, cfg.vocab_size)
    net = load_model(folder, torch.float32, device)
    sym_ = (not (True if zero_point is None else zero_point)) if method == "awq" else (True if sym is None else sym)
    # the GPTQ v1 layout stores zero - 1, so asymmetric grids there keep zero points >= 1
    qcfg = dict(bits=bits, group_size=group_size, sym=sym_, min_zero=1 if layout == "gptq" and not sym_ else 0)
    t0 = time.perf_counter()
    details: dict = {}
    rotated = None
    if rotation is not None:
        from llmopt.quant.rotation import rotate_model

        rotated = rotate_model(net)   # the same function, its outliers spread out; then quantized
    weights = fp8_modules = None
    if method == "rtn":
        from llmopt.quant.rtn import rtn_quantize

        weights = {name: rtn_quantize(net.get_submodule(name).weight.data, **qcfg)
                   for name in _bar(list(net.quantizable_linears()), progress, "rtn")}
    elif method == "gptq":
        weights = run_gptq(net, windows, qcfg, damp=damp, desc_act=bool(desc_act),
                           static_groups=bool(static_groups),
                           true_sequential=True if true_sequential is None else bool(true_sequential),
                           block_size=block_size, mse=float(mse or 0), progress=progress)
    elif method == "nf4":
        from llmopt.layers.quant.nf4 import NF4Weight

        dq = True if double_quant is None else bool(double_quant)
        weights = {name: NF4Weight.quantize(net.get_submodule(name).weight.data, group_size, dq)
                   for name in _bar(list(net.quantizable_linears()), progress, "nf4")}
    elif method == "awq":
        weights, details = run_awq(net, windows, qcfg, duo_scaling=duo_scaling is not False,
                                   apply_clip=apply_clip is not False, progress=progress)
    else:
        from llmopt.fp8.linear import Fp8Linear

        fp8_modules = {name: Fp8Linear.from_linear(net.get_submodule(name))
                       for name in _bar(list(net.quantizable_linears()), progress, "fp8")}
    seconds = time.perf_counter() - t0

    # -- the checkpoint ------------------------------------------------------------------------------------
    from llmopt.quant.checkpoint import linear_bytes, save_quantized

    config = quantization_config(method, bits, group_size, sym_, layout, damp=damp, desc_act=bool(desc_act),
                                 static_groups=bool(static_groups),
                                 true_sequential=True if true_sequential is None else bool(true_sequential),
                                 double_quant=double_quant is not False)
    if rotated is not None:
        config["meta"].update(rotated)   # folded into the weights: the loader needs nothing of it
    save_quantized(net, folder, out, config, weights, layout, fp8_modules)
    stored, fp16 = linear_bytes(net, weights, layout, fp8_modules)
    return QuantizeResult(out, method, bits, group_size, layout, seconds, stored, fp16,
                          0 if windows is None else windows.numel(), details)


def quantization_config(method, bits, group_size, sym, layout, damp=0.01, desc_act=False,
                        static_groups=False, true_sequential=True, double_quant=True) -> dict:
    """config.json's quantization_config, with the fields AutoGPTQ / AutoAWQ / vLLM /
    transformers' bitsandbytes integration read."""
    meta = {"quantizer": ["llmopt:0.1.0"], "method": method}
    if layout == "bitsandbytes":
        return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": double_quant,
                "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                "llm_int8_skip_modules": None, "meta": meta}
    if layout == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [], "meta": meta}
    if layout == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": not sym,
                "version": "gemm", "modules_to_not_convert": None, "meta": meta}
    return {"quant_method": "gptq", "checkpoint_format": "gptq", "bits": bits, "group_size": group_size,
            "desc_act": desc_act, "sym": sym, "damp_percent": damp, "static_groups": static_groups,
            "true_sequential": true_sequential, "lm_head": False, "meta": meta}


def calibration_windows_for(folder, calibration, num_samples, seq_len, vocab_size) -> torch.Tensor:
    from llmopt.model.loader import load_tokenizer
    from llmopt.quant.calibration import calibration_windows

    return calibration_windows(load_tokenizer(folder), calibration, num_samples, seq_len, vocab_size)


def _bar(items, progress: bool, desc: str):
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="layer", dynamic_ncols=True)


# -- the two calibrated methods, block by block ------------------------------------------------------------
LINEARS = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]


def run_gptq(model, windows, qcfg, damp, desc_act, static_groups, true_sequential, block_size,
             mse: float = 0.0, progress=True) -> dict[str, QuantizedWeight]:
    """GPTQ every block in order. With true_sequential, the linears of a block go in the order
    they run (qkv, o, gate_up, down), each calibrated on inputs that already pass through the
    quantized ones before it; the next block's inputs are this quantized block's outputs."""
    from llmopt.quant.calibration import BlockInputs
    from llmopt.quant.gptq import GPTQ

    runner = BlockInputs(model, windows)
    steps = [[n] for n in LINEARS] if true_sequential else [LINEARS]
    weights = {}
    for i, layer in enumerate(_bar(list(model.model.layers), progress, "gptq")):
        for names in steps:
            inputs, _ = runner.capture(layer, names)
            for name in names:
                linear = layer.get_submodule(name)
                gptq = GPTQ(linear.weight.data)
                gptq.add_batch(inputs[name.rsplit(".", 1)[-1]])
                w = gptq.quantize(qcfg["bits"], qcfg["group_size"], qcfg["sym"], damp, desc_act,
                                  static_groups, block_size, qcfg["min_zero"], mse)
                linear.weight.data = w.dequantize(linear.weight.dtype)  # what later steps see
                weights[f"model.layers.{i}.{name}"] = w
        runner.hidden = runner.run(layer)
    return weights


def run_awq(model, windows, qcfg, search_samples: int = 8, duo_scaling: bool = True, apply_clip: bool = True,
            progress=True) -> tuple[dict[str, QuantizedWeight], dict]:
    """AWQ every block: scales folded into the norms / previous linears, clipping, rounding.
    The alpha grid is scored on the first `search_samples` windows (20 forwards of the block
    each); mean |x| and the clipping search use every window."""
    from llmopt.quant.awq import awq_clip, awq_scale
    from llmopt.quant.calibration import BlockInputs
    from llmopt.quant.rtn import rtn_quantize

    cfg = model.config
    runner = BlockInputs(model, windows)
    weights, details = {}, {}
    fake = {k: qcfg[k] for k in ("bits", "group_size", "sym", "min_zero")}
    for i, layer in enumerate(_bar(list(model.model.layers), progress, "awq")):
        inputs, output = runner.capture(layer, LINEARS)
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        details[i] = awq_scale(layer, inputs, lambda x, layer=layer: runner.attention(layer, x), fake,
                               cfg.num_attention_heads, cfg.num_key_value_heads, q_size, kv_size,
                               search_tokens=min(search_samples, windows.shape[0]) * windows.shape[1],
                               duo_scaling=duo_scaling)
        if apply_clip:
            awq_clip(layer, inputs, fake, q_size, kv_size)
        for name in LINEARS:
            weights[f"model.layers.{i}.{name}"] = rtn_quantize(layer.get_submodule(name).weight.data, **fake)
        runner.hidden = output  # the full-precision block's output (scaling leaves it unchanged)
    return weights, details
