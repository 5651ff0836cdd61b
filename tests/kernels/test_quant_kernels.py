"""The Triton W4A16 kernel equals dequantize-then-matmul for both layouts (under
TRITON_INTERPRET=1 on CPU), and the quantized linear modules equal their dequantized weights."""


import pytest
import torch
import torch.nn.functional as F
from triton_checks import DEVICE, DTYPES, needs_triton

from llmopt.kernels.quant_matmul import awq_dequantize, gptq_dequantize, w4a16_matmul, w4a16_matmul_ref
from llmopt.layers.quant.awq import to_awq
from llmopt.layers.quant.formats import QuantizedWeight
from llmopt.layers.quant.gptq import to_gptq

DEV = DEVICE


def random_weight(K, N, group, act_order, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    G = K if group == -1 else group
    g_idx = torch.arange(K) // G
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    return QuantizedWeight(torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32),
                           (torch.rand(K // G, N, generator=g) * 0.05 + 1e-3).half(),
                           torch.randint(1, 16, (K // G, N), generator=g, dtype=torch.int32),
                           g_idx.int(), 4, group)


@needs_triton
@pytest.mark.parametrize("layout,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
@pytest.mark.parametrize("M,K,N,group", [(1, 128, 64, 32), (5, 256, 96, 128), (33, 64, 200, 16),
                                         (17, 96, 128, -1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a16_kernel_equals_reference(layout, act_order, M, K, N, group, dtype):
    if layout == "awq" and act_order:
        pytest.skip("AWQ has no g_idx")
    w = random_weight(K, N, group, act_order, seed=M + K)
    t = (to_gptq if layout == "gptq" else to_awq)(w)
    t = {k: v.to(DEV) for k, v in t.items()}
    g_idx = t.get("g_idx") if act_order else None
    G = K if group == -1 else group
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    # split-K: as chosen for this M (None), none, and 3 slices (the last one short or empty)
    for b, split in ((None, None), (bias, None), (bias, 1), (None, 3), (bias, 3)):
        got = w4a16_matmul(x, t["qweight"], t["qzeros"], t["scales"], g_idx, G, layout, b, split=split)
        want = w4a16_matmul_ref(x, t["qweight"], t["qzeros"], t["scales"], g_idx, G, layout, b)
        assert got.dtype == dtype and got.shape == (M, N)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


def test_reference_dequantizes_what_was_quantized():
    """The kernel's reference reads both layouts back to the weight the quantizer meant."""
    w = random_weight(128, 64, 32, act_order=True)
    t = to_gptq(w)
    assert torch.equal(gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"]).t(), w.dequantize())
    x = torch.randn(3, 128)
    torch.testing.assert_close(w4a16_matmul_ref(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 32),
                               x @ w.dequantize().t())
    w = random_weight(128, 64, 32, act_order=False)
    t = to_awq(w)
    assert torch.equal(awq_dequantize(t["qweight"], t["qzeros"], t["scales"], 32).t(), w.dequantize())


@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_quant_linear_equals_dequantize_then_matmul(layout):
    """The module the engine runs: on CPU exactly F.linear with the dequantized weight; on
    CUDA (4-bit) the Triton kernel, equal within rounding."""
    from llmopt.layers.quant.awq import AWQLinear
    from llmopt.layers.quant.gptq import GPTQLinear

    K, N = 128, 96
    w = random_weight(K, N, 32, act_order=layout == "gptq")
    t = (to_gptq if layout == "gptq" else to_awq)(w)
    m = (GPTQLinear if layout == "gptq" else AWQLinear)(K, N, 4, 32, bias=True)
    for name, tensor in t.items():
        m.load_checkpoint_tensor(name, tensor, None, name)
    m.load_checkpoint_tensor("bias", torch.randn(N), None, "bias")
    m.after_loading("test")
    m = m.to(DEV)
    x = torch.randn(2, 7, K, device=DEV)
    want = F.linear(x, w.dequantize().to(DEV), m.bias)
    if DEV == "cpu":
        assert torch.equal(m(x), want)
    else:
        torch.testing.assert_close(m(x), want, atol=1e-3, rtol=1e-3)
    assert m.weight_bytes() == sum(v.numel() * v.element_size() for v in t.values())
