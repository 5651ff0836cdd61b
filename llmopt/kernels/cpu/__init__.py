"""C++ CPU kernels, compiled on the learner's machine the first time they are used.

The sources beside this file are built once with `torch.utils.cpp_extension.load`, for the
host's own vector instructions (-O3 -march=native), into ~/.cache/llmopt/cpu_kernels/<hash>,
the hash covering the sources, the flags, and the torch and Python versions: a later process
imports the built library directly, at a negligible cost once torch is loaded, while the first
build is a long wait (measured: benchmarks/README.md, "Measurements behind the code's choices").
Without a working C++ compiler (or with LLMOPT_CPU_KERNELS=0) `available()` is False, one notice
says so, and callers take their plain torch paths.

What is here: `gguf_matmul` (GGUF Q8_0 / Q4_0 / Q4_1 blocks, and Q4_K / Q6_K super-blocks,
times activations), `kquant_matmul` (k-quant super-blocks, row ranges of both types stacked in
one weight), `dense_matmul` (a dense weight at a few rows of x), `paged_attention` (attention
reading the paged KV pool in place), and `decode_layers` (a decode step through every layer in
one call, llmopt/worker/compiled_decode.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

SOURCES = ("bindings.cpp", "dense_matmul.cpp", "dense_panels.cpp", "gguf_matmul.cpp", "gguf_panels.cpp",
           "kquant_matmul.cpp", "paged_attention.cpp", "decode_step.cpp")
HEADERS = ("common.h", "decode_step.h", "int_kv.h", "gguf_rows_avx2.h", "gguf_rows.h", "gguf_vnni.h", "gguf_panels.h", "kquant_rows.h",
           "paged_attention_avx512.h", "paged_attention_prompt.h")
BASE_CFLAGS = ("-O3", "-fopenmp", "-std=c++17")
# The host's own vector instructions, unless PyTorch is pinned to an ISA (ATEN_CPU_CAPABILITY, as
# the lessons pin AVX2 so that every x86 machine sums in the same order): then the same one here.
ISA_FLAGS = {"avx2": ("-mavx2", "-mfma", "-mf16c"), "default": ()}


def cflags() -> tuple[str, ...]:
    pinned = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return BASE_CFLAGS + ISA_FLAGS.get(pinned, ("-march=native",))

_HERE = Path(__file__).parent
_module = None
_failed: str | None = None


def cache_dir() -> Path:
    """Where built kernels are kept (LLMOPT_CACHE overrides ~/.cache/llmopt)."""
    root = os.environ.get("LLMOPT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmopt")
    return Path(root) / "cpu_kernels"


def _build_key() -> str:
    import torch

    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + (_HERE / name).read_bytes())
    h.update(repr((cflags(), torch.__version__, sys.version, os.environ.get("CXX", ""), cpu_flags())).encode())
    return h.hexdigest()[:16]


def cpu_flags() -> str:
    """The host's instruction sets: -march=native code built on one CPU may not run on another
    that shares the same home directory."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        import platform

        return platform.processor()


def _import_built(name: str, folder: Path):
    path = folder / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if not path.exists():
        path = folder / f"{name}.so"
    if not path.exists():
        return None
    import torch  # noqa: F401  (the library links against torch's, which must be loaded first)

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, folder: Path):
    from torch.utils import cpp_extension

    # ninja's default runs cores + 2 compilers at once, each 350-450 MB: on a 2-core, 2 GB Binder
    # that alone fills the container. One compiler per core (MAX_JOBS, torch's knob, if not set).
    if "MAX_JOBS" not in os.environ:
        os.environ["MAX_JOBS"] = str(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                         else os.cpu_count() or 1))
    return cpp_extension.load(name=name, sources=[str(_HERE / s) for s in SOURCES],
                              extra_cflags=list(cflags()), extra_include_paths=[str(_HERE)],
                              extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


def load(notice: Callable[[str], None] | None = None):
    """The compiled module (built first if needed), or None where it cannot be built.

    `notice` (e.g. `print`) is told when a build starts and when it is done: the first build is
    long (see the module's docstring), which a learner should not mistake for a hung cell. A
    process that finds the kernels built says nothing, so a warm cache prints nothing."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    if os.environ.get("LLMOPT_CPU_KERNELS", "1") == "0":
        _failed = "LLMOPT_CPU_KERNELS=0"
        return None
    try:
        key = _build_key()
        name = f"llmopt_cpu_{key}"
        folder = cache_dir() / key
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "build.lock", "w") as lock:   # one build at a time, across processes
            fcntl.flock(lock, fcntl.LOCK_EX)
            _module = _import_built(name, folder)
            if _module is None:
                start = time.monotonic()
                if notice:
                    notice(f"llmopt: compiling its C++ CPU kernels for this CPU into {folder} "
                           "(once per machine; about a minute on 2 cores)...")
                _module = _build(name, folder)
                if notice:
                    notice(f"llmopt: C++ CPU kernels built in {time.monotonic() - start:.0f} s")
    except Exception as e:  # no compiler, a failed build, an unwritable cache: torch paths instead
        _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        warnings.warn(f"llmopt: the C++ CPU kernels could not be built ({_failed[:200]}); "
                      "running the torch paths instead", RuntimeWarning, stacklevel=2)
    return _module


def available() -> bool:
    """Whether the C++ kernels are built and loaded (building them on the first call)."""
    return load() is not None


def why_unavailable() -> str | None:
    """The reason `available()` is False (None when it is True or not yet asked)."""
    return _failed


def dense_panels(weight):
    """A bfloat16 weight [N, K] repacked for dense_panels.cpp: panels of 32 rows, pair by pair of
    columns, [N / 32, K / 2, 2, 16, 2] (element [g, j, v, r, t] = W[32 g + 16 v + r, 2 j + t]).
    None where that kernel does not run it: not bf16, N not a multiple of 32, K odd, or a build
    without AVX-512 (then dense_matmul.cpp's row kernel takes W as it is)."""
    import torch

    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 32 or k % 2 or not available() or not load().dense_panels_supported():
        return None
    return weight.detach().reshape(n // 32, 2, 16, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous()


__all__ = ["available", "load", "cache_dir", "cpu_flags", "dense_panels", "why_unavailable"]
