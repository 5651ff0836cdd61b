"""Quantized weights in memory and on disk.

Every integer quantizer here (RTN, GPTQ, AWQ) produces the same thing, a `QuantizedWeight`:
integers q in [0, 2^bits) shaped like the linear's weight [out, in], and per group of
`group_size` input columns one scale and one zero point per output row, so that

    W[n, k] ~ scales[g_idx[k], n] * (q[n, k] - zeros[g_idx[k], n])

What differs between tools is only how that is packed into int32 words on disk (the two
Hugging Face layouts are described in `llmopt.kernels.quant_matmul`, which unpacks them): `pack`
here is the bit stream both use; each format's file (gptq.py, awq.py, int8.py, nf4.py,
gguf_linear.py) holds its layout, its linear and its dequantize reference. `QuantScheme` reads a
checkpoint's `quantization_config` (or the engine's `quantization=` argument) and says which
linear module the loader must build, rejecting what llmopt does not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GPTQ_BITS = (2, 3, 4, 8)
AWQ_BITS = (4,)


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor   # [out, in] integers in [0, 2^bits)
    scales: torch.Tensor    # [groups, out] float16
    zeros: torch.Tensor     # [groups, out] integers in [0, 2^bits)
    g_idx: torch.Tensor     # [in] group of each input column
    bits: int
    group_size: int         # -1: one group spans the whole row (per-channel)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] = scale * (q - zero), in fp32 (exact), then cast."""
        g = self.g_idx.long()
        s, z = self.scales.float()[g].t(), self.zeros[g].t()
        return ((self.qweight - z).float() * s).to(dtype)

    def rows(self, start: int, end: int) -> "QuantizedWeight":
        """Output rows start..end: one checkpoint shard (q_proj, ...) of a fused weight."""
        return QuantizedWeight(self.qweight[start:end], self.scales[:, start:end], self.zeros[:, start:end],
                               self.g_idx, self.bits, self.group_size)

    @property
    def has_act_order(self) -> bool:
        g = torch.arange(self.shape[1], device=self.g_idx.device) // self._group
        return not torch.equal(self.g_idx.long(), g)

    @property
    def _group(self) -> int:
        return self.shape[1] if self.group_size == -1 else self.group_size


# -- packing: the inverse of llmopt.kernels.quant_matmul.unpack --------------------------------------
def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers in [0, 2^bits) -> int32 words, as one little-endian bit stream along `dim`
    (value j at bits j*bits ..). The size along `dim` shrinks by 32 / bits and must divide."""
    v = values.movedim(dim, -1).to(torch.int64)
    n = v.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"{n} values of {bits} bits do not fill whole int32 words")
    if v.numel() and (v.min() < 0 or v.max() >= 1 << bits):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack into {bits} bits")
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = torch.arange(0, 32, bits, device=v.device)
        words = (v.view(*v.shape[:-1], n // per_word, per_word) << shifts).sum(-1)
    else:  # 3 bits: lay the values out bit by bit, then read 32 bits per word
        bit = torch.arange(bits, device=v.device)
        stream = ((v.unsqueeze(-1) >> bit) & 1).flatten(-2)
        stream = stream.view(*stream.shape[:-1], -1, 32)
        words = (stream << torch.arange(32, device=v.device)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # uint32 bits -> int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


# -- what a checkpoint asks for ------------------------------------------------------------------------
@dataclass
class QuantScheme:
    """A checked quantization_config: which quantized linear the loader builds."""

    method: str                    # "gptq" | "awq" | "fp8" | "int8" | "nf4" (bitsandbytes 4-bit)
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    activation_scheme: str = "dynamic"   # fp8: per-token scales on the fly, or a stored input_scale
    serialized: bool = True        # weights on disk are quantized; False: quantize while loading
    not_converted: list[str] = field(default_factory=list)

    def converts(self, checkpoint_names: list[str]) -> bool:
        """Whether a linear (by its checkpoint module names) is quantized, or listed as kept."""
        return not any(skip and skip in n for skip in self.not_converted for n in checkpoint_names)

    @classmethod
    def from_config(cls, qc: dict, source: str = "config.json") -> "QuantScheme":
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: quantization_config must be an object, got {qc!r}")
        method = str(qc.get("quant_method", "")).lower()
        where = f"{source}: quantization_config"
        if method == "gptq":
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt != "gptq":
                raise ValueError(f"{where} checkpoint_format {fmt!r} is not supported; llmopt loads the "
                                 "v1 'gptq' format (AutoGPTQ, GPTQModel with format='gptq')")
            if qc.get("lm_head"):
                raise ValueError(f"{where} quantizes lm_head, which llmopt keeps dense; re-quantize with lm_head=False")
            s = cls("gptq", bits=_int(qc, "bits", where), group_size=_int(qc, "group_size", where),
                    sym=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)))
            if s.bits not in GPTQ_BITS:
                raise ValueError(f"{where} bits={s.bits}: the GPTQ layout has {GPTQ_BITS}")
        elif method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where} version {version!r} is not supported; llmopt loads AWQ 'gemm' checkpoints")
            bits = _int(qc, "bits" if "bits" in qc else "w_bit", where)
            group = _int(qc, "group_size" if "group_size" in qc else "q_group_size", where)
            s = cls("awq", bits=bits, group_size=group, sym=not qc.get("zero_point", True),
                    not_converted=_names(qc, "modules_to_not_convert", where))
            if bits not in AWQ_BITS:
                raise ValueError(f"{where} bits={bits}: the AWQ GEMM layout is 4-bit only")
        elif method == "fp8":
            scheme = qc.get("activation_scheme", "dynamic")
            if scheme not in ("dynamic", "static"):
                raise ValueError(f"{where} activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
            if qc.get("weight_block_size"):
                raise ValueError(f"{where} weight_block_size: block-wise FP8 is not supported; "
                                 "llmopt loads per-tensor or per-channel weight scales")
            return cls("fp8", bits=8, group_size=-1, activation_scheme=scheme,
                       not_converted=_names(qc, "ignored_layers", where))
        elif method == "bitsandbytes":
            if qc.get("load_in_8bit") or not qc.get("load_in_4bit"):
                raise ValueError(f"{where}: of bitsandbytes, llmopt loads 4-bit weights (load_in_4bit), "
                                 "not LLM.int8()")
            kind = str(qc.get("bnb_4bit_quant_type", "fp4"))
            storage = str(qc.get("bnb_4bit_quant_storage", "uint8"))
            if kind not in ("nf4", "fp4") or storage != "uint8":
                raise ValueError(f"{where}: bnb_4bit_quant_type {kind!r} / quant_storage {storage!r}; llmopt "
                                 "loads 'nf4' or 'fp4' codes stored as uint8")
            # bitsandbytes' block size (64 unless a Params4bit was made otherwise; each tensor's
            # quant_state says, and the layer checks it)
            return cls("nf4", bits=4, group_size=64,
                       not_converted=_names(qc, "llm_int8_skip_modules", where))
        elif method == "compressed-tensors":
            return cls._from_compressed_tensors(qc, where)
        else:
            raise ValueError(f"{where} quant_method {qc.get('quant_method')!r} is not supported; "
                             "llmopt loads 'gptq', 'awq', 'fp8', 'bitsandbytes' (4-bit) "
                             "and FP8 'compressed-tensors'")
        if s.group_size != -1 and s.group_size < 1:
            raise ValueError(f"{where} group_size must be -1 or positive, got {s.group_size}")
        return s

    @classmethod
    def _from_compressed_tensors(cls, qc: dict, where: str) -> "QuantScheme":
        """llm-compressor's FP8 ("float-quantized") checkpoints: the same tensors as "fp8"."""
        groups = list((qc.get("config_groups") or {}).values())
        w = groups[0].get("weights", {}) if len(groups) == 1 else {}
        if not (w.get("type") == "float" and w.get("num_bits") == 8
                and w.get("strategy") in ("tensor", "channel") and not qc.get("kv_cache_scheme")):
            raise ValueError(f"{where}: of compressed-tensors, llmopt loads one FP8 weight group "
                             "(type float, 8 bits, tensor or channel strategy)")
        act = groups[0].get("input_activations") or {}
        return cls("fp8", bits=8, group_size=-1,
                   activation_scheme="dynamic" if act.get("dynamic", True) else "static",
                   not_converted=[i.removeprefix("re:") for i in _names(qc, "ignore", where)])

    @classmethod
    def on_load(cls, quantization: str) -> "QuantScheme":
        """`LLM(quantization="fp8" | "int8")`: quantize a full-precision checkpoint while loading."""
        if quantization not in ("fp8", "int8"):
            raise ValueError(f"quantization must be None, 'fp8' or 'int8', got {quantization!r}")
        return cls(quantization, bits=8, group_size=-1, serialized=False)


def _int(qc: dict, key: str, where: str) -> int:
    value = qc.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} needs an integer {key!r}, got {value!r}")
    return value


def _names(qc: dict, key: str, where: str) -> list[str]:
    """A list of module names (modules_to_not_convert, ...). A string was split into its letters,
    which matched every layer (all kept dense, then "checkpoint lacks" every weight); a number
    raised TypeError ("'in <string>' requires string") in the loader."""
    value = qc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} {key} must be a list of module names, got {value!r}")
    return value
