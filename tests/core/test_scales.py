"""Scale encodings against their definitions, computed independently in exact Python arithmetic."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from quantscope.formats import FP4_E2M1, FP6_E2M3, FP6_E3M2, FP8_E4M3, FP8_E5M2, INT8, IntFormat
from quantscope.scales import (
    E8M0_MODES,
    POW2_MODES,
    ScaleEncoding,
    e8m0_scale,
    encode_scale,
    nvfp4_global_scale,
)

MXINT8_ELEM = IntFormat(8, narrow=True)
ELEMENTS = [FP8_E4M3, FP8_E5M2, FP6_E3M2, FP6_E2M3, FP4_E2M1, MXINT8_ELEM]


def edge_values(seed=0, n=3000):
    """Positive float32 values around powers of two and element maxima, plus random ones."""
    g = torch.Generator().manual_seed(seed)
    k = torch.arange(-140, 128, dtype=torch.float32)
    p2 = torch.exp2(k)
    elem_max = torch.tensor([448.0, 57344.0, 28.0, 7.5, 6.0, 127.0, 127.5, 7.75, 1.75, 1.96875])
    grid = (elem_max[:, None] * torch.exp2(torch.arange(-20, 20.0))[None, :]).flatten()
    base = torch.cat([p2, grid, p2 * 1.5, p2 * 1.75, p2 * 1.875, p2 * 1.9375, p2 * 1.96875])
    rnd = torch.exp2(torch.rand(n, generator=g) * 80 - 40)
    x = torch.cat([base, torch.nextafter(base, torch.zeros(())), torch.nextafter(base, base * 4),
                   rnd])
    return x[torch.isfinite(x) & (x > 0)]


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, round to nearest even, by integer arithmetic on the bits."""
    b = x.view(torch.int32).long()
    b = (b + 0x7FFF + ((b >> 16) & 1)) & ~0xFFFF
    return b.to(torch.int32).view(torch.float32)


def test_fp16_and_bf16_round_to_nearest_even():
    x = edge_values()
    x = x[(x >= 6.2e-5) & (x <= 60000)]  # normal fp16 range: numpy's cast is the reference
    expect16 = torch.from_numpy(x.numpy().astype(np.float16).astype(np.float32))
    assert torch.equal(encode_scale(x, ScaleEncoding("fp16")), expect16)
    y = edge_values(1)
    y = y[(y < 3e38) & (y > 1e-40)]  # below: saturation to the smallest subnormal (next test)
    assert torch.equal(encode_scale(y, ScaleEncoding("bf16")), bf16_rne(y))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_fp16_bf16_saturate_and_never_flush_to_zero(kind):
    info = torch.finfo(torch.float16 if kind == "fp16" else torch.bfloat16)
    out = encode_scale(torch.tensor([1e-45, 1e-30, 1e30, 3.4e38]), ScaleEncoding(kind))
    assert torch.isfinite(out).all() and (out > 0).all()
    assert out[-1] == info.max
    assert out[0] == info.smallest_normal * info.eps


def pow2_ref(s: float, mode: str) -> float:
    m, e = math.frexp(s)  # s = m * 2**e, 0.5 <= m < 1: exact
    floor_k = e - 1
    if mode == "floor":
        k = floor_k
    elif mode == "ceil":
        k = floor_k if m == 0.5 else e
    else:  # round(log2 s): up iff (2m)**2 >= 2, exact in float64 for a 24-bit mantissa
        k = e if (2 * m) ** 2 >= 2 else floor_k
    return 2.0 ** min(max(k, -149), 127)


@pytest.mark.parametrize("mode", POW2_MODES)
def test_pow2_modes(mode):
    x = edge_values(2)
    sqrt2 = torch.exp2(torch.arange(-30, 30.0)) * math.sqrt(2)
    x = torch.cat([x, sqrt2, torch.nextafter(sqrt2, sqrt2 * 2), torch.nextafter(sqrt2, 0 * sqrt2)])
    got = encode_scale(x, ScaleEncoding("pow2", mode))
    expect = torch.tensor([pow2_ref(v, mode) for v in x.tolist()])
    assert torch.equal(got, expect)
    if mode == "floor":
        assert (got <= x).all()
    if mode == "ceil":  # up to 2**127, the largest power of two below float32's max
        assert (got >= x)[x <= 2.0**127].all()


def e8m0_ref(amax: float, fmt, mode: str) -> float:
    """The four MX modes from their definitions (scales.py), exact."""
    if amax == 0:
        k = -127
    else:
        m, e = math.frexp(amax)
        if mode == "floor":
            k = e - 1 - fmt.emax
        elif mode == "ceil":
            k = (e - 1 if m == 0.5 else e) - fmt.emax
        elif mode == "even":
            step = 2.0 ** (e - 1 - fmt.mbits)
            r = math.floor(amax / step + 0.5) * step  # half away from zero (positive)
            k = math.frexp(r)[1] - 1 - fmt.emax
        else:  # rceil: the smallest 2**k with amax <= max * 2**k, in exact fractions
            k = e - math.frexp(fmt.max)[1] - 2  # below it: amax / max >= 2 ** (e - ef - 1)
            while Fraction(fmt.max) * Fraction(2) ** k < Fraction(amax):
                k += 1
    return 2.0 ** min(max(k, -127), 127)


@pytest.mark.parametrize("mode", E8M0_MODES)
@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_e8m0_modes_match_their_definitions(fmt, mode):
    amax = torch.cat([torch.zeros(1), edge_values(3, n=500)])
    got = e8m0_scale(amax, fmt, mode)
    expect = torch.tensor([e8m0_ref(v, fmt, mode) for v in amax.tolist()])
    assert torch.equal(got, expect)
    # every scale is a power of two in [2**-127, 2**127]
    m, _ = torch.frexp(got)
    assert (m == 0.5).all() and (got >= 2.0**-127).all() and (got <= 2.0**127).all()


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_e8m0_rceil_is_exact_where_the_quotient_is_subnormal(fmt):
    """amax just above max * 2 ** -127 (and -128, -126): a float32 amax / max is subnormal and
    rounded onto the power of two below, which gave 2 ** -127 (scale byte 0x00, as torchao's
    RCEIL) where the exact rule, the smallest unclipping scale, is 2 ** -126."""
    edge = torch.tensor([fmt.max * 2.0**k for k in (-128, -127, -126)])
    amax = torch.cat([edge, torch.nextafter(edge, torch.tensor(math.inf))])
    got = e8m0_scale(amax, fmt, "rceil")
    assert got.tolist() == [2.0**-127, 2.0**-127, 2.0**-126, 2.0**-127, 2.0**-126, 2.0**-125]
    assert (amax / got <= fmt.max).all()  # never clips


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_e8m0_mode_properties(fmt):
    """floor may clip (amax / s < 2 ** (emax + 1)); rceil and ceil never clip; even lies between."""
    amax = edge_values(4)
    amax = amax[(amax > 2.0**-100) & (amax < 2.0**100)]
    s = {m: e8m0_scale(amax, fmt, m) for m in E8M0_MODES}
    assert (amax / s["floor"] >= 2.0**fmt.emax).all() and (amax / s["floor"] < 2.0 ** (fmt.emax + 1)).all()
    assert (amax / s["rceil"] <= fmt.max).all() and (amax / s["ceil"] <= 2.0**fmt.emax).all()
    assert (s["floor"] <= s["even"]).all() and (s["even"] <= 2 * s["floor"]).all()
    assert (s["rceil"] <= s["ceil"]).all()
    # even moves the exponent up exactly when the largest element would round past the binade
    bumped = s["even"] > s["floor"]
    top = amax / s["floor"] / 2.0**fmt.emax  # in [1, 2)
    assert torch.equal(bumped, top >= 2 - 2.0 ** -(fmt.mbits + 1))


def test_bfp16_overflow_check_is_the_even_mode():
    """BFP16: exponent floor(log2 amax) - 6, bumped when the max mantissa rounds to 128."""
    amax = torch.tensor([1.0, 1.98, 1.984375, 1.9921875, 127.0, 127.5, 127.49]) * 0.25
    s = e8m0_scale(amax, MXINT8_ELEM, "even")
    code = torch.round(amax / (torch.exp2(torch.floor(torch.log2(amax))) / 64))
    expect = torch.exp2(torch.floor(torch.log2(amax)) - 6 + (code >= 128).float())
    assert torch.equal(s, expect)
    assert (torch.round(amax / s) <= 127).all()


def test_e8m0_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        e8m0_scale(torch.ones(1), FP4_E2M1, "nearest")


def test_nvfp4_global_scale():
    amax = torch.tensor([1.0, 2688.0, 1e-3, 0.0, float("inf"), float("nan"), 1e-44])
    gs = nvfp4_global_scale(amax, FP4_E2M1)
    # inf counts as float32's max (issue 20: a global scale of 0 made every scale inf)
    expect = 448.0 * 6.0 / amax.clamp(max=torch.finfo(torch.float32).max)
    ok = torch.isfinite(expect) & (amax > 0)
    assert torch.equal(gs[ok], expect[ok])
    assert (gs[~ok] == 1).all() and torch.isfinite(gs).all() and (gs > 0).all()


def test_fp8_block_scale_encoding_is_e4m3():
    x = edge_values(5)
    x = x[x < 448]
    assert torch.equal(encode_scale(x, ScaleEncoding("fp8_e4m3")), x.to(torch.float8_e4m3fn).float())
    with pytest.raises(ValueError, match="e8m0"):
        encode_scale(x, ScaleEncoding("e8m0"))


def test_encoding_parse_and_errors():
    assert ScaleEncoding.parse("pow2") == ScaleEncoding("pow2", "round")
    assert ScaleEncoding.parse("E8M0:RCEIL") == ScaleEncoding("e8m0", "rceil")
    assert ScaleEncoding.parse("e8m0").mode == "floor" and ScaleEncoding("fp32").mode is None
    assert str(ScaleEncoding("pow2", "ceil")) == "pow2:ceil"
    assert ScaleEncoding("fp8_e4m3").is_block and ScaleEncoding("fp8_e4m3").has_global_scale
    assert ScaleEncoding("fp8_e4m3").default_eps == 0.125
    with pytest.raises(ValueError, match="kind"):
        ScaleEncoding("fp64")
    with pytest.raises(ValueError, match="mode"):
        ScaleEncoding("pow2", "even")
    with pytest.raises(ValueError, match="mode"):
        ScaleEncoding("fp16", "floor")
    assert INT8.emax == 6
