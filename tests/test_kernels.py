"""Every Triton kernel equals its plain-torch reference (under TRITON_INTERPRET=1 on CPU)."""

import os

import pytest
import torch

from llmopt.kernels import HAS_TRITON

pytestmark = pytest.mark.skipif(
    not HAS_TRITON or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton: a CUDA device, or TRITON_INTERPRET=1 (set by tests/conftest.py)")


# The interpreter cannot store bfloat16 (numpy has no such type): bf16 is checked on CUDA only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 384), (5, 100)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_reference(rows, cols, dtype):
    from llmopt.kernels.rms_norm import rms_norm, rms_norm_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(dev, dtype)
    w = torch.randn(cols, generator=g).to(dev, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=tol, rtol=tol)


def test_rms_norm_reference_is_the_models_norm():
    from llmopt.kernels.rms_norm import rms_norm_ref
    from llmopt.layers.norm import RMSNorm

    norm = RMSNorm(48, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 48)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-6))
