"""What the Triton kernel tests share: when they can run, and the dtypes they cover."""

import os

import pytest
import torch

from llmopt.kernels import HAS_TRITON

needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton: a CUDA device, or TRITON_INTERPRET=1 (set by tests/conftest.py)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter cannot store bfloat16 (numpy has no such type): bf16 is checked on CUDA only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
