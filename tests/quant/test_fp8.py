"""FP8 format helpers: the constants, clamp-then-cast, scales, and round trips at the
edges of both formats (largest value, smallest normal, subnormals, beyond the range, zero).

The expected values are worked out from the bit layout (sign, exponent, mantissa), not
read back from torch, so the tests check torch's casts as much as our wrappers.
"""

import math

import pytest
import torch

from llmopt.fp8.format import (E4M3, E5M2, FP8_E4M3_MAX, FP8_E5M2_MAX, dequantize_fp8, fp8_format,
                        fp8_neighbours, fp8_values, min_scale, native_fp8_supported,
                        per_channel_scale, per_tensor_scale, per_token_scale, quantize_fp8,
                        quantize_fp8_per_channel, quantize_fp8_per_tensor, quantize_fp8_per_token,
                        scale_from_amax)

FORMATS = [E4M3, E5M2]


def decode_bits(fmt, bits: int) -> float:
    """The value of an 8-bit pattern, from the OCP FP8 definition."""
    m_bits, e_bits = fmt.mantissa_bits, fmt.exponent_bits
    sign = -1.0 if bits >> 7 else 1.0
    e = (bits >> m_bits) & ((1 << e_bits) - 1)
    m = bits & ((1 << m_bits) - 1)
    if fmt is E4M3 and e == 15 and m == 7:
        return math.nan                       # e4m3fn: only S.1111.111 is NaN, no infinities
    if fmt is E5M2 and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:                                # subnormal: no implicit 1
        return sign * m * 2.0 ** (1 - fmt.exponent_bias - m_bits)
    return sign * (1 + m / 2 ** m_bits) * 2.0 ** (e - fmt.exponent_bias)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_constants_match_the_bit_layout_and_torch(fmt):
    values = [decode_bits(fmt, b) for b in range(256)]
    finite = [v for v in values if math.isfinite(v)]
    assert max(finite) == fmt.max == torch.finfo(fmt.dtype).max
    assert min(v for v in finite if v > 0) == fmt.min_subnormal
    assert fmt.min_normal == 2.0 ** (1 - fmt.exponent_bias) == torch.finfo(fmt.dtype).smallest_normal
    # every bit pattern decodes in torch as the definition says
    got = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float().tolist()
    for b, (want, have) in enumerate(zip(values, got)):
        assert (math.isnan(want) and math.isnan(have)) or want == have, (fmt.name, b, want, have)
    # the sorted grid: all finite values once (+0 and -0 are one)
    assert fp8_values(fmt.dtype).tolist() == sorted(set(finite))
    assert fmt.num_finite_values == len(set(finite))


def test_format_lookup_and_bad_names():
    assert fp8_format("fp8") is E4M3 and fp8_format("fp8_e4m3") is E4M3 and fp8_format("e4m3fn") is E4M3
    assert fp8_format("fp8_e5m2") is E5M2 and fp8_format(torch.float8_e5m2) is E5M2
    assert FP8_E4M3_MAX == 448.0 and FP8_E5M2_MAX == 57344.0
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8_format("e3m4")
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8_format(torch.float16)
    with pytest.raises(TypeError, match="float8"):
        dequantize_fp8(torch.ones(3), 1.0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_representable_value_round_trips_exactly(fmt):
    grid = fp8_values(fmt.dtype)
    for scale in (1.0, 0.37, 2.0 ** -10):
        x = grid * scale
        back = dequantize_fp8(quantize_fp8(x, scale, fmt.dtype), scale)
        # dividing by a non-power-of-two scale rounds once in fp32; the cast then lands on
        # the same grid point (the fp32 error is far below half an FP8 step)
        assert torch.equal(back / scale, grid) if scale != 0.37 else torch.allclose(back, x, rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_edges_max_min_normal_subnormal_zero(fmt):
    q = lambda v: quantize_fp8(torch.tensor([v]), 1.0, fmt.dtype).float().item()  # noqa: E731
    assert q(fmt.max) == fmt.max and q(-fmt.max) == -fmt.max
    assert q(fmt.min_normal) == fmt.min_normal
    assert q(fmt.min_subnormal) == fmt.min_subnormal
    assert q(3 * fmt.min_subnormal) == 3 * fmt.min_subnormal           # a subnormal in the middle
    # half the smallest subnormal is a tie between 0 and it: round to even gives 0
    assert q(fmt.min_subnormal / 2) == 0.0
    assert q(fmt.min_subnormal * 0.51) == fmt.min_subnormal
    assert q(0.0) == 0.0 and q(-0.0) == 0.0
    zero = quantize_fp8(torch.zeros(4), 1.0, fmt.dtype)
    assert torch.equal(dequantize_fp8(zero, 1.0), torch.zeros(4))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_beyond_max_clamps_instead_of_nan_or_inf(fmt):
    x = torch.tensor([fmt.max * 1.01, fmt.max * 10, 1e30, -1e30, math.inf, -math.inf])
    q = quantize_fp8(x, 1.0, fmt.dtype).float()
    assert torch.isfinite(q).all()
    assert q.tolist() == [fmt.max, fmt.max, fmt.max, -fmt.max, fmt.max, -fmt.max]


def test_unclamped_e5m2_cast_overflows_which_is_why_we_clamp():
    # The reason for the clamp, shown: a plain cast past the top of e5m2 gives inf.
    # (e4m3fn has no inf: torch's cast saturates to 448, a non-saturating conversion gives NaN.)
    assert torch.tensor([1e6]).to(torch.float8_e5m2).float().isinf().all()
    assert torch.isfinite(quantize_fp8(torch.tensor([1e6]), 1.0, torch.float8_e5m2).float()).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_trip_error_is_within_half_a_step(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    q, scale = quantize_fp8_per_tensor(x, fmt.dtype)
    back = dequantize_fp8(q, scale)
    # relative step of the format is 2^-mantissa_bits; round to nearest errs by at most half of it
    # for normal values (below min_normal * scale the absolute step is fixed)
    rel_bound = 2.0 ** -(fmt.mantissa_bits + 1)
    abs_bound = fmt.min_subnormal * scale / 2
    err = (back - x).abs()
    assert (err <= torch.maximum(rel_bound * x.abs(), abs_bound) * (1 + 1e-6)).all()
    assert not torch.isnan(back).any()
    # the scale maps the tensor's largest magnitude onto the format's largest value
    assert q.float().abs().max().item() == fmt.max


def test_scales_per_tensor_channel_token():
    w = torch.tensor([[1.0, -4.0], [0.5, 0.25], [0.0, 0.0]])
    assert per_tensor_scale(w).item() == pytest.approx(4.0 / 448)
    assert per_channel_scale(w).shape == (3, 1)
    assert per_channel_scale(w)[:, 0].tolist() == pytest.approx([4 / 448, 0.5 / 448, min_scale()])
    x = torch.randn(2, 5, 8)
    assert per_token_scale(x).shape == (2, 5, 1)
    assert torch.allclose(per_token_scale(x, torch.float8_e5m2), x.abs().amax(-1, keepdim=True) / 57344)
    assert scale_from_amax(0.0).item() == pytest.approx(min_scale()) and min_scale() > 0
    with pytest.raises(ValueError, match="2-D weight"):
        per_channel_scale(torch.ones(4))


@pytest.mark.parametrize("how", ["channel", "token"])
def test_per_row_quantization_uses_each_rows_full_range(how):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=g) * torch.logspace(-3, 3, 6)[:, None]  # rows of very different size
    x[2] = 0.0                                                               # and an all-zero row
    q, s = quantize_fp8_per_channel(x) if how == "channel" else quantize_fp8_per_token(x)
    amax = q.float().abs().amax(dim=1)
    assert amax[[0, 1, 3, 4, 5]].eq(448).all() and amax[2] == 0
    back = dequantize_fp8(q, s)
    assert not torch.isnan(back).any() and torch.equal(back[2], torch.zeros(32))
    assert ((back - x).abs() <= x.abs().amax(1, keepdim=True) / 16).all()


def test_dequantize_to_half_dtypes_is_exact():
    grid = fp8_values(torch.float8_e4m3fn)
    q = grid.to(torch.float8_e4m3fn)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(dequantize_fp8(q, 1.0, dtype).float(), grid)


def test_neighbours_of_a_value():
    n = fp8_neighbours(300.0)                  # e4m3 near the top: steps of 32
    assert (n["below"], n["above"], n["rounded"]) == (288.0, 320.0, 288.0)
    assert n["error"] == -12.0 and n["relative_error"] == pytest.approx(0.04)
    n = fp8_neighbours(1000.0)                 # beyond max: clamped
    assert n["rounded"] == 448.0 and n["below"] == n["above"] == 448.0
    n = fp8_neighbours(2.0, torch.float8_e5m2)  # exactly representable
    assert n["below"] == n["above"] == n["rounded"] == 2.0 and n["error"] == 0.0


def test_native_support_is_false_on_cpu():
    assert native_fp8_supported("cpu") is False
