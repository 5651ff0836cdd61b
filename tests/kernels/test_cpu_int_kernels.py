"""torch's CPU weight-only int8 / int4 kernels (llmopt.layers.quant.cpu_int) against the dense path.

The reference is the dense copy: the same integers and scales dequantized to a float weight
and multiplied by F.linear in fp32. The kernels run bf16 activations, so they agree with it
to bf16's rounding of the inputs and outputs (relative 2^-8), not bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.layers.quant import cpu_int
from llmopt.layers.quant.cpu_int import Int4Weight, Int8Weight
from llmopt.layers.quant.awq import AWQLinear, to_awq
from llmopt.layers.quant.gptq import GPTQLinear, to_gptq
from llmopt.layers.quant.int8 import Int8Linear
from llmopt.quant.rtn import rtn_quantize


def close_to_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """got (bf16) ~ x @ w.T computed in fp32 from the same bf16 inputs."""
    want = x.float() @ w.float().t()
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), (err, want.abs().max().item())


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3])
def test_int4_kernel_equals_its_dequantized_weight(group, rows):
    g = torch.Generator().manual_seed(group + rows)
    n, k = 96, 256
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(k // group, n, generator=g) * 0.02 + 0.001
    zp = torch.randint(0, 16, (k // group, n), generator=g)
    w = Int4Weight.from_affine(q, scale, zp, torch.bfloat16)
    # the formula the kernel implements: (q - 8) * s + z with z = s * (8 - zp) -> s * (q - zp)
    exact = (q.float() - zp.float().repeat_interleave(group, 0).t()) * scale.repeat_interleave(group, 0).t()
    # exact up to bf16's rounding of scale and zero (|zero| <= 8 scale): 2^-8 relative each
    assert (w.dequantize() - exact).abs().max() <= 2 ** -8 * 17 * scale.max()
    x = torch.randn(rows, k, generator=g).bfloat16()
    close_to_fp32(w.matmul(x), x, w.dequantize())


def test_int8_kernel_equals_its_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(80, 192, generator=g)
    w = Int8Weight.quantize(dense, torch.bfloat16)
    assert (w.dequantize() - dense).abs().max() <= dense.abs().amax(1).max() / 127
    x = torch.randn(2, 192, generator=g).bfloat16()
    close_to_fp32(w.matmul(x), x, w.dequantize())


def test_shapes_the_int4_kernel_cannot_run_are_named():
    q = torch.zeros(24, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="out_features 24 not a multiple of 16"):
        Int4Weight(q, torch.ones(2, 24), torch.zeros(2, 24), torch.bfloat16)
    with pytest.raises(ValueError, match=r"group size 16 \(the int4 kernel takes"):
        Int4Weight(torch.zeros(32, 64, dtype=torch.int32), torch.ones(4, 32), torch.zeros(4, 32), torch.bfloat16)
    with pytest.raises(ValueError, match="activations, not torch.float32"):
        Int8Weight(torch.zeros(16, 32, dtype=torch.int8), torch.ones(16), torch.float32)


def layer(kind: str, n=128, k=256, group=64, bias=True, seed=0):
    """A quantized linear loaded from an RTN quantization of a random weight."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=g) * 0.05
    if kind == "int8":
        lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
        lin.weight.data.copy_(dense)
        return Int8Linear.from_linear(lin)
    qw = rtn_quantize(dense, 4, group, sym=kind == "gptq", min_zero=1 if kind == "gptq" else 0)
    cls, tensors = (GPTQLinear, to_gptq(qw)) if kind == "gptq" else (AWQLinear, to_awq(qw))
    m = cls(k, n, 4, group, bias=bias, dtype=torch.bfloat16)
    for name, t in tensors.items():
        m.load_checkpoint_tensor(name, t, None, name)
    if bias:
        m.load_checkpoint_tensor("bias", torch.randn(n, generator=g).bfloat16(), None, "bias")
    m.after_loading("test")
    return m


@pytest.mark.parametrize("kind", ["gptq", "awq", "int8"])
def test_quantized_linears_run_the_kernel_and_match_the_dense_reference(kind):
    m = layer(kind)
    x = torch.randn(2, 3, m.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = m(x[:, :1])                                  # 2 rows: the kernel
    assert m._kernel is not None and m._kernel[1] is not None
    ref = F.linear(x[:, :1].float(), m.dequantize(torch.float32), m.bias.float())
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    err = (y.float() - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item()
    # above KERNEL_MAX_ROWS rows the dense copy runs: it holds the kernel's own weights
    big = torch.randn(cpu_int.KERNEL_MAX_ROWS + 4, m.in_features).bfloat16()
    dense = m(big)
    kernel_rows = torch.cat([m(big[i:i + 1]) for i in range(big.shape[0])])
    assert (dense.float() - kernel_rows.float()).abs().max() <= 2e-2 * dense.float().abs().max()
    # fp32 activations (a float32 model: its bias is fp32 too) keep the fp32 dense path
    m.bias.data = m.bias.data.float()
    y32 = m(x[:, :1].float())
    assert torch.allclose(y32, F.linear(x[:, :1].float(), m.dequantize(torch.float32), m.bias.float()),
                          atol=1e-5)


def test_act_order_and_odd_shapes_fall_back_to_the_dense_copy():
    m = layer("gptq")
    m.g_idx.data.copy_(torch.randperm(m.in_features) // m.group_size)
    m.after_loading("test")
    assert m.act_order and m.to_kernel_weight(torch.bfloat16) is None
    x = torch.randn(1, m.in_features).bfloat16()
    assert torch.allclose(m(x).float(), F.linear(x, m.dense_weight(torch.bfloat16), m.bias).float())
    odd = layer("awq", n=40, k=256, group=64)        # 40 output channels: not a multiple of 16
    assert odd.to_kernel_weight(torch.bfloat16) is None
    assert odd(x).shape == (1, 40)


def test_int8_model_in_bf16_generates_like_its_dense_copy():
    """The whole tiny model quantized to int8: decode through the kernel, prefill dense."""
    from llmopt import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny", dtype="bfloat16", quantization="int8", num_kv_blocks=64)
    got = llm.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    linears = [m for m in llm.llm_engine.model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m._kernel is not None and m._kernel[1] is not None for m in linears)
    old = cpu_int.KERNEL_MAX_ROWS
    try:
        cpu_int.KERNEL_MAX_ROWS = 0                  # every call takes the dense copy
        for m in linears:
            m._dense = None
        want = llm.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        cpu_int.KERNEL_MAX_ROWS = old
    same = sum(a == b for a, b in zip(got, want))
    assert got[:8] == want[:8] and same >= len(want) - 4, (got, want)
