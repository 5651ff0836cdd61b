"""Every engine knob in one validated dataclass, spelled as vLLM spells it.

Validation happens here, before any weights load: a wrong value is a `ValueError`
(or `TypeError`) naming the argument and what is allowed.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from dataclasses import dataclass
from numbers import Integral, Real

import torch

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
KV_CONNECTORS = ("SharedMemoryConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_SCALE_STRATEGIES = ("tensor", "attn_head")  # calculate_kv_scales besides True / False
QUANTIZATION = (None, "fp8", "int8", "gguf")
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: the checkpoint's weights, or random ones of its shape
SPEC_METHODS = ("draft_model", "ngram", "eagle", "layer_skip")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
PREFIX_CACHES = ("hash", "radix")
SEED_RANGE = (-2**63, 2**64)  # what torch.manual_seed takes
# bfloat16 arithmetic arrives with Ampere; Colab's free T4 (Turing, 7.5) has none
BF16_CAPABILITY = (8, 0)
logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model: str | os.PathLike = "tiny"
    tokenizer: str | os.PathLike | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"   # or "priority" (vLLM), "lpm" (longest cached prefix first, SGLang)
    kv_cache_dtype: str = "auto"
    # FP8 KV: measure k/v scales on calibration text at load: True (or "tensor", vLLM's: one scale per
    # layer for keys and one for values) or "attn_head" (compressed-tensors' name: one per KV head)
    calculate_kv_scales: bool | str = False
    kv_cache_rotation: str | None = None  # "hadamard": keys and values turned before they are stored
    quantization: str | None = None
    speculative_config: dict | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False
    async_scheduling: bool = False    # vLLM's: queue the next decode step before reading this one (SGLang's overlap)
    # SGLang's name: a request's tokens independent of the batch it runs in (kernels whose reduction
    # order ignores the batch); None: vLLM's switch, the environment's VLLM_BATCH_INVARIANT=1
    enable_deterministic_inference: bool | None = None
    prefix_cache: str = "hash"        # "hash": vLLM's chained block hashes; "radix": SGLang's radix tree
    # vLLM's KV offloading: GiB of a tier below the pool that keeps evicted prefix blocks for their next
    # hit (on a GPU host memory; on the CPU, whose pool is host memory, a file on disk), the backend
    # ("native": llmopt/engine/kv_offload.py), and the folder of the disk tier's file (CPU: a temporary
    # folder when None; GPU: a disk tier below the host one only when given)
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    kv_offloading_path: str | os.PathLike | None = None
    # vLLM's disaggregated prefill / decode: {"kv_connector": "SharedMemoryConnector", "kv_role":
    # "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {"path": folder}}
    # (llmopt/engine/kv_transfer.py)
    kv_transfer_config: dict | None = None
    load_format: str = "auto"         # "dummy": the model's shape with random weights (speed only)
    # Not in vLLM's LLM signature but in its spirit: the CPU KV budget (vLLM reads the
    # VLLM_CPU_KVCACHE_SPACE environment variable), and an opt-in per-step trace.
    # GiB of RAM for the KV block pool on CPU; None: the LLMOPT_CPU_KVCACHE_SPACE or
    # VLLM_CPU_KVCACHE_SPACE environment variable, else sized from free memory (see
    # llmopt.engine.kv_budget.kv_blocks_from_budget)
    cpu_kv_cache_space: float | None = None
    enable_trace: bool = False

    def __post_init__(self):
        # paths as the rest of Python takes them: a string or any os.PathLike (pathlib.Path)
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        # a number here reached the tokenizer loader as "expected str, bytes or os.PathLike object"
        if self.tokenizer is not None and not (isinstance(self.tokenizer, str) and self.tokenizer):
            raise TypeError(f"tokenizer must be a model name, a folder (a non-empty string or os.PathLike) "
                            f"or None (the model's own), got {self.tokenizer!r}")
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1) or self.block_size < 8:
            raise ValueError(f"block_size must be a power of two >= 8 (8, 16, 32, ...), got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        _real("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.cpu_kv_cache_space is None:
            self.cpu_kv_cache_space = _cpu_kv_space_from_env()
        if self.cpu_kv_cache_space is not None:
            _real("cpu_kv_cache_space", self.cpu_kv_cache_space)
            # inf passed and then sized the pool as "cannot convert float NaN to integer"
            if not 0 < self.cpu_kv_cache_space < float("inf"):
                raise ValueError(f"cpu_kv_cache_space (GiB) must be a finite number > 0, got {self.cpu_kv_cache_space}")
        v = self.calculate_kv_scales
        if not (isinstance(v, bool) or (isinstance(v, str) and v in KV_SCALE_STRATEGIES)):
            raise ValueError(f"calculate_kv_scales must be False, True (= 'tensor': one scale per layer) or "
                             f"'attn_head' (one per KV head), got {self.calculate_kv_scales!r}")
        if self.kv_cache_rotation not in (None, "hadamard"):
            raise ValueError(f"kv_cache_rotation must be None or 'hadamard', got {self.kv_cache_rotation!r}")
        if self.kv_cache_rotation is not None and not self.calculate_kv_scales:
            raise ValueError("kv_cache_rotation='hadamard' turns keys and values before their scales are measured; "
                             "set calculate_kv_scales=True (or 'attn_head') too")
        if self.enable_deterministic_inference is None:
            self.enable_deterministic_inference = _batch_invariant_from_env()
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "enable_trace",
                     "async_scheduling", "enable_deterministic_inference"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, SCHEDULING_POLICIES))}, "
                             f"got {self.scheduling_policy!r}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be 'hash' (vLLM's chained block hashes) or 'radix' "
                             f"(SGLang's radix tree), got {self.prefix_cache!r}")
        if not self.enable_prefix_caching:
            for bad, what in ((self.prefix_cache == "radix", "prefix_cache='radix' chooses the prefix cache"),
                              (self.scheduling_policy == "lpm", "scheduling_policy='lpm' orders requests "
                               "by their cached prefix")):
                if bad:
                    raise ValueError(f"{what}, but enable_prefix_caching=False turns the cache off; "
                                     "set enable_prefix_caching=True (or leave the default)")
        self._check_offloading()
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = check_kv_transfer_config(self.kv_transfer_config)
            if not self.enable_prefix_caching:
                raise ValueError("kv_transfer_config hands a prompt's blocks over through the prefix cache; "
                                 "enable_prefix_caching=False turns it off")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if str(self.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but no CUDA device is available; use 'cpu' or 'auto'")
        # a torch.dtype too must be one the model runs in: torch.int64 failed in nn.Module.to
        ok = self.dtype in DTYPES.values() if isinstance(self.dtype, torch.dtype) else (
            isinstance(self.dtype, str) and (self.dtype == "auto" or self.dtype in DTYPES))
        if not ok:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)} (or that torch.dtype), "
                             f"got {self.dtype!r}")
        if self.dtype != "auto":  # bfloat16 on a GPU without it is refused here, before anything loads
            self.torch_dtype(None)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype.startswith("fp8") and not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs torch's float8 dtypes "
                             f"(torch >= 2.1; this is {torch.__version__}); allowed here: 'auto', 'bfloat16'")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError("calculate_kv_scales=True calibrates the scales of an FP8 KV cache; "
                             "set kv_cache_dtype='fp8' (or 'fp8_e5m2') too")
        if self.quantization not in QUANTIZATION:
            raise ValueError(f"quantization must be None, 'fp8' or 'int8' (or 'gguf' for a GGUF file), "
                             f"got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto' (the checkpoint's weights) or 'dummy' (random "
                             f"weights of the model's shape, for speed only), got {self.load_format!r}")
        if self.load_format == "dummy":
            # random weights: what would read them as text or calibrate on them is refused here
            for bad, what in ((self.quantization == "gguf", "quantization='gguf' keeps a GGUF file's own "
                               "blocks; write random ones with `llmopt quantize --method gguf --load-format "
                               "dummy` and load that file"),
                              (self.calculate_kv_scales, "calculate_kv_scales=True calibrates on text"),
                              (self.speculative_config is not None, "speculative_config drafts tokens whose "
                               "acceptance depends on trained weights")):
                if bad:
                    raise ValueError(f"load_format='dummy' builds random weights: {what}, so the two are "
                                     "not allowed together")
        if self.speculative_config is not None:
            sc = self.speculative_config
            if not isinstance(sc, dict):
                raise TypeError(f"speculative_config must be a dict, got {sc!r}")
            method = sc.get("method")
            if method not in SPEC_METHODS:
                raise ValueError(f"speculative_config['method'] must be one of {', '.join(SPEC_METHODS)}, "
                                 f"got {method!r}")
            allowed = {"method", "num_speculative_tokens"} | (
                {"prompt_lookup_min", "prompt_lookup_max"} if method == "ngram"
                else {"exit_layer"} if method == "layer_skip" else {"model", "tree"} if method == "eagle"
                else {"model"})
            unknown = set(sc) - allowed
            if unknown:
                raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} for {method!r}; "
                                 f"allowed: {', '.join(sorted(allowed))}")
            if "num_speculative_tokens" not in sc:
                raise ValueError("speculative_config needs 'num_speculative_tokens' (a positive integer)")
            _positive_int("speculative_config['num_speculative_tokens']", sc["num_speculative_tokens"])
            if method == "ngram":
                for key, default in (("prompt_lookup_max", 4), ("prompt_lookup_min", 1)):
                    _positive_int(f"speculative_config['{key}']", sc.get(key, default))
                if sc.get("prompt_lookup_min", 1) > sc.get("prompt_lookup_max", 4):
                    raise ValueError("speculative_config: prompt_lookup_min must be <= prompt_lookup_max")
            elif method == "layer_skip":
                if "exit_layer" not in sc:
                    raise ValueError("speculative_config for 'layer_skip' needs 'exit_layer' (how many of "
                                     "the target's first layers draft, 1 <= exit_layer < num_hidden_layers)")
                _positive_int("speculative_config['exit_layer']", sc["exit_layer"])
            elif "model" in sc and not (isinstance(sc["model"], str) and sc["model"]):
                raise TypeError(f"speculative_config['model'] must be a model name or folder, "
                                f"got {sc['model']!r}")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling=True queues a decode step before the last one is read; with "
                             "speculative_config the next drafts need the verified tokens first, so the two "
                             "are not allowed together")
        if self.enable_deterministic_inference:
            # Batch invariance is the compiled CPU step's (llmopt/worker/compiled_decode.py). The eager
            # path multiplies with torch's GEMM, which blocks and splits by the row count; on a GPU the
            # Triton kernels would need the same: one tile shape and no split-K at every batch size,
            # attention split at fixed key positions, CUDA graphs recorded per bucket kept as they are.
            for bad, what in ((self.enforce_eager, "enforce_eager=True runs torch's matmuls, whose order of "
                               "additions changes with the number of rows"),
                              (self.torch_device().type == "cuda", "on CUDA the Triton kernels choose their tiles "
                               "and splits by the batch (run it with device='cpu')")):
                if bad:
                    raise ValueError(f"enable_deterministic_inference=True (or VLLM_BATCH_INVARIANT=1) needs the "
                                     f"compiled CPU step, and {what}")
        _int("seed", self.seed)
        if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:  # 2**70 failed in torch.manual_seed, after loading
            raise ValueError(f"seed must be in [-2**63, 2**64) (what torch.manual_seed takes), got {self.seed}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            # what the parallel workers do not split (yet): refused here rather than run wrong
            refused = [(self.speculative_config is not None, "speculative_config"),
                       (self.async_scheduling, "async_scheduling=True"),  # pipelining already overlaps steps
                       (self.enable_deterministic_inference, "enable_deterministic_inference=True"),
                       # the copy-on-write of partly matched blocks runs in this process's pool only
                       (self.prefix_cache == "radix", "prefix_cache='radix'"),
                       (self.kv_cache_dtype != "auto", f"kv_cache_dtype={self.kv_cache_dtype!r}"),
                       (self.kv_offloading_size is not None, "kv_offloading_size"),
                       (self.kv_transfer_config is not None, "kv_transfer_config"),
                       (self.quantization is not None and self.tensor_parallel_size > 1,
                        f"quantization={self.quantization!r} (with tensor_parallel_size > 1)")]
            for bad, what in refused:
                if bad:
                    raise ValueError(f"{what} is not supported with tensor_parallel_size="
                                     f"{self.tensor_parallel_size}, pipeline_parallel_size="
                                     f"{self.pipeline_parallel_size}; allowed there: the defaults "
                                     "(pipeline parallelism alone keeps quantized layers whole)")

    def _check_offloading(self) -> None:
        if isinstance(self.kv_offloading_path, os.PathLike):
            self.kv_offloading_path = os.fspath(self.kv_offloading_path)
        size, backend, path = self.kv_offloading_size, self.kv_offloading_backend, self.kv_offloading_path
        if backend not in (None, "native"):
            raise ValueError(f"kv_offloading_backend must be 'native' (or None: 'native' when kv_offloading_size "
                             f"is set), got {backend!r}")
        if size is None:
            if backend is not None or path is not None:
                raise ValueError("kv_offloading_backend / kv_offloading_path describe the offload tier; set "
                                 "kv_offloading_size (GiB of it) too")
            return
        _real("kv_offloading_size", size)
        if not 0 < size < float("inf"):
            raise ValueError(f"kv_offloading_size (GiB) must be a finite number > 0, got {size}")
        self.kv_offloading_backend = "native"
        if path is not None and not (isinstance(path, str) and os.path.isdir(path)):
            raise ValueError(f"kv_offloading_path must be an existing folder (the disk tier's file goes there), "
                             f"got {path!r}")
        for bad, what in ((not self.enable_prefix_caching, "enable_prefix_caching=False (the tier serves "
                           "prefix-cache hits)"),
                          (self.speculative_config is not None, "speculative_config (a draft's KV shares the "
                           "blocks and is not offloaded)")):
            if bad:
                raise ValueError(f"kv_offloading_size keeps evicted prefix blocks below the pool; it is not "
                                 f"allowed with {what}")

    # -- resolved values ------------------------------------------------------------------
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """The model's dtype on this config's device: `resolve_dtype` with the GPU's compute capability."""
        device = self.torch_device()
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return resolve_dtype(self.dtype, device.type, capability, checkpoint_dtype)


def check_kv_transfer_config(cfg) -> dict:
    """vLLM's kv_transfer_config, checked (ValueError naming what is wrong), with the folder of the
    transfer files filled in (shared memory: /dev/shm where the OS has it)."""
    if not isinstance(cfg, dict):
        raise TypeError(f"kv_transfer_config must be a dict, got {cfg!r}")
    unknown = set(cfg) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}; allowed: kv_connector, kv_role, "
                         "kv_connector_extra_config")
    if cfg.get("kv_connector") not in KV_CONNECTORS:
        raise ValueError(f"kv_transfer_config['kv_connector'] must be one of {', '.join(KV_CONNECTORS)}, "
                         f"got {cfg.get('kv_connector')!r}")
    if cfg.get("kv_role") not in KV_ROLES:
        raise ValueError(f"kv_transfer_config['kv_role'] must be one of {', '.join(KV_ROLES)}, got {cfg.get('kv_role')!r}")
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict) or set(extra) - {"path"}:
        raise ValueError(f"kv_transfer_config['kv_connector_extra_config'] takes only 'path' (the folder of the "
                         f"transfer files), got {extra!r}")
    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    folder = extra.get("path") or ("/dev/shm" if shm else tempfile.gettempdir())
    if not (isinstance(folder, str) and os.path.isdir(folder)):
        raise ValueError(f"kv_transfer_config['kv_connector_extra_config']['path'] must be an existing folder, "
                         f"got {folder!r}")
    return {**cfg, "kv_connector_extra_config": {"path": folder}}


def _batch_invariant_from_env() -> bool:
    """vLLM's switch: VLLM_BATCH_INVARIANT=1 (or 0 / unset: off); any other value is refused."""
    raw = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip()
    if raw not in ("0", "1", ""):
        raise ValueError(f"VLLM_BATCH_INVARIANT must be 1 (batch-invariant kernels) or 0, got {raw!r}")
    return raw == "1"


def resolve_dtype(dtype: str | torch.dtype, device_type: str, capability: tuple[int, int] | None,
                  checkpoint_dtype: str | None) -> torch.dtype:
    """The dtype the model runs in, vLLM's policy, decided from the arguments alone (no device is
    asked, so any GPU can be tested anywhere). `capability` is the CUDA compute capability, None
    off CUDA; `checkpoint_dtype` is config.json's torch_dtype ("float32", "bfloat16", ...) or None.

    - An explicit dtype is itself, but bfloat16 on a CUDA GPU below compute capability 8.0 is
      refused (ValueError): those GPUs have no bfloat16 arithmetic. float16 and float32 run there.
    - 'auto' on a CPU: float32 (exact, and fast enough there).
    - 'auto' on a GPU from 8.0: a float16 checkpoint's float16, else bfloat16 (a float32 checkpoint
      too: half the bytes, float32's range).
    - 'auto' on a GPU below 8.0: float16, said once (a bfloat16 checkpoint loses range: values past
      65504 overflow).
    """
    bf16_ok = device_type != "cuda" or capability is None or tuple(capability) >= BF16_CAPABILITY
    if dtype != "auto":
        resolved = dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]
        if resolved == torch.bfloat16 and not bf16_ok:
            raise ValueError(f"dtype={dtype!r} needs bfloat16 arithmetic, which CUDA GPUs have from compute "
                             f"capability {BF16_CAPABILITY[0]}.{BF16_CAPABILITY[1]}; this GPU has "
                             f"{capability[0]}.{capability[1]}; allowed here: 'float16' (or 'half'), "
                             "'float32', or 'auto' (float16 here)")
        return resolved
    if device_type != "cuda":
        return torch.float32
    if not bf16_ok:
        _notice_float16_for_auto(tuple(capability))
        return torch.float16
    return {"float16": torch.float16}.get(checkpoint_dtype or "", torch.bfloat16)


@functools.cache
def _notice_float16_for_auto(capability: tuple[int, int]) -> None:
    logger.warning("dtype='auto' is float16 on this GPU: compute capability %d.%d has no bfloat16 "
                   "arithmetic (that needs >= 8.0; vLLM falls back the same way); pass dtype='float32' "
                   "for float32's range", *capability)


def _cpu_kv_space_from_env() -> float | None:
    for var in ("LLMOPT_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        text = os.environ.get(var, "").strip()
        if text:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{var}={text!r}: must be a number of GiB (> 0)") from None
            # vLLM reads 0 as "size it automatically"
            return value if value != 0 else None
    return None


def _int(name, v):
    if isinstance(v, bool) or not isinstance(v, Integral):
        raise TypeError(f"{name} must be an integer, got {v!r}")


def _positive_int(name, v):
    _int(name, v)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")


def _real(name, v):
    if isinstance(v, bool) or not isinstance(v, Real):
        raise TypeError(f"{name} must be a number, got {v!r}")
