"""Triton kernels, each beside the plain-torch reference it must equal.

Kernels import nothing from the engine (nor from this package's face: each module is
imported by name, `llmopt.kernels.paged_attention`). On CPU they run
under the Triton interpreter (TRITON_INTERPRET=1), which is how the tests hold them
equal to their references; on CUDA they compile.
"""

from __future__ import annotations

import importlib.util
import os

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_usable(device) -> bool:
    """Triton kernels run compiled on CUDA, or anywhere under the interpreter."""
    if not HAS_TRITON:
        return False
    return str(device).startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"


__all__ = ["HAS_TRITON", "triton_usable"]
