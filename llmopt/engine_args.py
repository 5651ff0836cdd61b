"""Engine flags on a command line, spelled as vLLM spells them (its EngineArgs).

`llmopt generate / chat / bench / serve` all take them; `engine_kwargs` turns parsed flags
back into `LLM(...)` keyword arguments, so every tool that builds an engine from flags
(the CLI, the benchmarks) builds the same one.
"""

from __future__ import annotations

import argparse
import json


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (vLLM spelling)")
    g.add_argument("--model", default="tiny",
                   help="known name (tiny, smollm2, ...), local HF folder, .gguf file or hub id")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "lpm"],
                   help="lpm: longest cached prefix first (SGLang)")
    g.add_argument("--prefix-cache", default="hash", choices=["hash", "radix"],
                   help="hash: vLLM's chained block hashes; radix: SGLang's radix tree (token granularity)")
    g.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of a tier below the KV pool that keeps evicted prefix blocks for their next hit "
                        "(GPU: host memory; CPU: a file on disk)")
    g.add_argument("--kv-offloading-backend", default=None, choices=["native"])
    g.add_argument("--kv-offloading-path", default=None,
                   help="folder of the offload tier's file (CPU: a temporary folder by default)")
    g.add_argument("--kv-transfer-config", type=_json_dict, default=None,
                   help='disaggregated prefill / decode, e.g. \'{"kv_connector": "SharedMemoryConnector", '
                        '"kv_role": "kv_producer"}\' (or kv_consumer; llmopt router sits in front of the two)')
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"],
                   help="int8 / int4: integer codes, keys grouped per block and channel, values per token and "
                        "32 (int8) or 64 (int4) channels (KIVI's grouping)")
    g.add_argument("--calculate-kv-scales", nargs="?", const=True, default=False, choices=["tensor", "attn_head"],
                   help="FP8 KV cache: measure k/v scales on calibration text at start, one per layer "
                        "(no value, or 'tensor') or one per KV head ('attn_head')")
    g.add_argument("--kv-cache-rotation", default=None, choices=["hadamard"],
                   help="FP8 KV cache: turn keys and values by a Hadamard matrix before measuring their scales")
    g.add_argument("--quantization", default=None, choices=["fp8", "int8", "gguf"],
                   help="gguf: keep a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks for the CPU int kernels")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: the model's shape with random weights, for speed only (e.g. --model llama-3.2-1b)")
    g.add_argument("--speculative-config", type=_json_dict, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", type=int, default=1)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--async-scheduling", action="store_true",
                   help="queue the next decode step before reading this one (SGLang's overlap scheduler)")
    g.add_argument("--enable-deterministic-inference", action="store_true", default=None,
                   help="batch-invariant kernels: a request's tokens independent of its neighbours "
                        "(SGLang's flag; VLLM_BATCH_INVARIANT=1 is the same switch)")


ENGINE_FLAGS = ["model", "tokenizer", "dtype", "device", "block_size", "num_kv_blocks",
                "gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy", "prefix_cache",
                "kv_offloading_size", "kv_offloading_backend", "kv_offloading_path", "kv_transfer_config",
                "kv_cache_dtype", "calculate_kv_scales", "kv_cache_rotation", "quantization", "load_format",
                "speculative_config", "seed", "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager",
                "async_scheduling", "enable_deterministic_inference"]


def engine_kwargs(args) -> dict:
    return {k: getattr(args, k) for k in ENGINE_FLAGS}


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
