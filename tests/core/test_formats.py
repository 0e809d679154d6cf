"""Number formats, checked exhaustively against their bit-level definitions and torch's casts."""

import math

import pytest
import torch

from quantscope.formats import (
    FORMATS,
    FP4_E2M1,
    FP6_E2M3,
    FP6_E3M2,
    FP8_E4M3,
    FP8_E5M2,
    FloatFormat,
    IntFormat,
    get_format,
)

FLOATS = [FP8_E4M3, FP8_E5M2, FP6_E3M2, FP6_E2M3, FP4_E2M1]
# codes that are not finite numbers: e4m3fn gives exponent=all-ones/mantissa=all-ones to NaN
# (no inf); e5m2 is IEEE (exponent all-ones is inf/NaN); the fp6/fp4 MX formats use every code.
NON_FINITE = {"fp8_e4m3": lambda e, m, f: e == 2**f.ebits - 1 and m == 2**f.mbits - 1,
              "fp8_e5m2": lambda e, m, f: e == 2**f.ebits - 1}
EXPECTED_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "fp6_e3m2": 28.0, "fp6_e2m3": 7.5,
                "fp4_e2m1": 6.0}


def value_table(f: FloatFormat):
    """Every finite non-negative value with the parity of its mantissa field, from the bit fields.

    Independent of FloatFormat.round: sign / exponent / mantissa with bias 2**(ebits-1) - 1,
    exponent field 0 is subnormal (0.m * 2**(1 - bias)).
    """
    bias = 2 ** (f.ebits - 1) - 1
    out = {}
    for e in range(2**f.ebits):
        for m in range(2**f.mbits):
            if NON_FINITE.get(f.name, lambda *a: False)(e, m, f):
                continue
            if e == 0:
                v = m / 2**f.mbits * 2.0 ** (1 - bias)
            else:
                v = (1 + m / 2**f.mbits) * 2.0 ** (e - bias)
            out[v] = m % 2 == 0
    values = sorted(out)
    return values, [out[v] for v in values]


def all_bits_as_float32(dtype):
    """Every bit pattern of a 16-bit float dtype, as float32 (NaN and inf included)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()


@pytest.mark.parametrize("f", FLOATS, ids=lambda f: f.name)
def test_table_max_and_every_value_maps_to_itself(f):
    values, _ = value_table(f)
    assert max(values) == EXPECTED_MAX[f.name] == f.max
    assert f.emax == math.floor(math.log2(f.max))
    t = torch.tensor(values)
    full = torch.cat([t, -t])
    for fn in (f.round, lambda t: f.round(t.clone(), inplace=True)):
        assert torch.equal(fn(full), full)
    # signed zero survives
    assert torch.signbit(f.round(torch.tensor([-0.0]))).item()


@pytest.mark.parametrize("f", FLOATS, ids=lambda f: f.name)
def test_midpoints_round_to_even_mantissa_and_neighbours_to_nearest(f):
    values, even = value_table(f)
    lo, hi = torch.tensor(values[:-1]), torch.tensor(values[1:])
    mid = (lo + hi) / 2  # exact in float32: at most 2 more bits than the format
    expect = torch.where(torch.tensor(even[:-1]), lo, hi)
    # exactly one of the two neighbours has an even mantissa
    assert (torch.tensor(even[:-1]) != torch.tensor(even[1:])).all()
    below = torch.nextafter(mid, lo)
    above = torch.nextafter(mid, hi)
    for fn in (f.round, lambda t: f.round(t.clone(), inplace=True)):
        assert torch.equal(fn(mid), expect)
        assert torch.equal(fn(-mid), -expect)
        assert torch.equal(fn(below), lo)
        assert torch.equal(fn(above), hi)


@pytest.mark.parametrize("f", FLOATS, ids=lambda f: f.name)
def test_beyond_max_saturates_with_sign(f):
    x = torch.tensor([f.max * 1.0001, f.max * 1.5, f.max * 2, 3e38, float("inf")])
    for fn in (f.round, lambda t: f.round(t.clone(), inplace=True)):
        assert torch.equal(fn(x), torch.full_like(x, f.max))
        assert torch.equal(fn(-x), torch.full_like(x, -f.max))
    assert torch.isnan(f.round(torch.tensor([float("nan")]))).all()


@pytest.mark.parametrize("ebits", [3, 8])
def test_inf_saturates_without_mantissa_bits_too(ebits):
    # probe s40: with mbits 0, inf's step (its all-ones exponent field) was inf itself, and
    # inf / inf made NaN, where the docs promise saturation; the C kernels and Triton agree
    from quantscope.qdq import fake_quantize

    f = FloatFormat(f"e{ebits}m0", ebits, 0, 2.0 ** (2 ** (ebits - 1) - 1))
    x = torch.tensor([float("inf"), -float("inf"), 3e38, float("nan")])
    got = f.round(x)
    assert torch.equal(got[:3], torch.tensor([f.max, -f.max, f.max])) and got[3].isnan()
    from quantscope import QParams, QuantSpec

    qp = QParams(torch.tensor(1.0), torch.tensor(0))
    fq = fake_quantize(x[:3], qp, QuantSpec(f, "tensor"))
    assert torch.equal(fq, torch.tensor([f.max, -f.max, f.max]))


def test_int_rounding_is_float32_for_half_inputs_too():
    # probe s40: INT16.round of a bfloat16 tensor worked in bfloat16, where the module
    # promises float32 arithmetic and results: its clamp to 32767 gave 32768 (bf16's nearest)
    from quantscope.formats import INT16

    got = INT16.round(torch.tensor([40000.0, -40000.0, -2.5]).bfloat16())
    assert got.dtype == torch.float32 and got.tolist() == [32767.0, -32768.0, -2.0]


def nearest_even(f: FloatFormat, x: torch.Tensor) -> torch.Tensor:
    """Brute force: the nearest table value (saturating), ties to the even mantissa, with sign."""
    values, even = value_table(f)
    table = torch.tensor(values, dtype=torch.float64)
    parity = torch.tensor(even)
    a = x.double().abs().clamp(max=f.max)
    d = (a[:, None] - table[None, :]).abs()
    best = d == d.min(1, keepdim=True).values
    # among the (at most two) nearest, prefer the even mantissa
    pick = best & (parity[None, :] | (best.sum(1, keepdim=True) == 1))
    return torch.copysign(table[pick.float().argmax(1)].float(), x)


@pytest.mark.parametrize("f", FLOATS, ids=lambda f: f.name)
def test_every_bf16_and_fp16_value_rounds_to_the_nearest_table_value(f):
    """Brute force on 2 x 65536 inputs: nearest table value, ties to the even mantissa."""
    for dtype in (torch.bfloat16, torch.float16):
        x = all_bits_as_float32(dtype)
        x = x[torch.isfinite(x)]
        got = f.round(x)
        assert torch.equal(got, nearest_even(f, x))
        assert torch.equal(torch.signbit(got), torch.signbit(x))
        assert torch.equal(f.round(x.clone(), inplace=True), got)


@pytest.mark.parametrize("f", [FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
def test_fp8_equals_torch_cast_within_range(f):
    g = torch.Generator().manual_seed(0)
    values, _ = value_table(f)
    t = torch.tensor(values)
    x = torch.cat([
        all_bits_as_float32(torch.bfloat16), all_bits_as_float32(torch.float16),
        (t[:-1] + t[1:]) / 2,
        torch.randn(100_000, generator=g) * f.max / 4,
        torch.randn(100_000, generator=g) * 2.0 ** f.min_exp,  # subnormals
    ])
    x = x[torch.isfinite(x) & (x.abs() <= f.max)]
    x = torch.cat([x, -x])
    ref = x.to(f.torch_dtype).float()
    assert torch.equal(f.round(x), ref)


@pytest.mark.parametrize("f", FLOATS, ids=lambda f: f.name)
def test_random_float32_of_every_magnitude(f):
    """Random float32 from 2**-30 to 2**30 (float32 subnormals, inf and huge values too)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-30, 30, (20_000,), generator=g))
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -3e38])])
    got = f.round(x)
    assert torch.equal(got, nearest_even(f, x))
    if f.torch_dtype is not None:  # torch's cast (which need not saturate) of the clamped value
        assert torch.equal(got, x.clamp(-f.max, f.max).to(f.torch_dtype).float())
    strided = x[:19_998].reshape(99, 202).t()[::3]  # non-contiguous views
    assert torch.equal(f.round(strided), f.round(strided.contiguous()))


@pytest.mark.parametrize("bits", range(2, 17))
@pytest.mark.parametrize("signed,narrow", [(True, False), (True, True), (False, False)])
def test_int_ranges_and_half_to_even(bits, signed, narrow):
    f = IntFormat(bits, signed, narrow)
    if signed:
        assert (f.qmin, f.qmax) == (-(2 ** (bits - 1)) + narrow, 2 ** (bits - 1) - 1)
    else:
        assert (f.qmin, f.qmax) == (0, 2**bits - 1)
    assert f.max == f.qmax and 2**f.emax <= f.max < 2 ** (f.emax + 1)
    codes = torch.arange(f.qmin, f.qmax + 1, dtype=torch.float32)
    assert torch.equal(f.round(codes), codes)
    halves = codes[:-1] + 0.5
    expect = torch.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    assert torch.equal(f.round(halves), expect)
    assert torch.equal(f.round(torch.nextafter(halves, codes[1:])), codes[1:])
    out = f.round(torch.tensor([f.qmin - 0.6, f.qmax + 0.6, -1e30, 1e30]))
    assert out.tolist() == [f.qmin, f.qmax, f.qmin, f.qmax]
    assert f.round(torch.tensor([5.4]), 2, 3).tolist() == [3.0]
    assert get_format(f.name) == f


@pytest.mark.parametrize("kwargs,field", [
    ({"bits": 1}, "bits"), ({"bits": 17}, "bits"), ({"bits": 8.0}, "bits"),
    ({"bits": 8, "signed": False, "narrow": True}, "narrow"),
])
def test_int_format_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        IntFormat(**kwargs)


def test_get_format_names_and_aliases():
    for name, f in FORMATS.items():
        assert get_format(name) is f and get_format(f) is f
    assert get_format("fp8") is FP8_E4M3 and get_format("E2M1") is FP4_E2M1
    assert get_format("e3m2") is FP6_E3M2 and get_format("e2m3") is FP6_E2M3
    assert get_format("int5") == IntFormat(5) and get_format("uint3") == IntFormat(3, False)
    assert get_format("int4_narrow").qmin == -7
    for bad in ("int1", "int17", "fp7", "float"):
        with pytest.raises(ValueError, match="format"):
            get_format(bad)


@pytest.mark.parametrize("f", [*FLOATS, IntFormat(4), IntFormat(8, False)], ids=lambda f: f.name)
def test_inplace_rounding_gives_the_same_values(f):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 50
    expect = f.round(x)
    y = x.clone()
    out = f.round(y, inplace=True)
    assert torch.equal(out, expect) and out.data_ptr() == y.data_ptr()  # y itself, rounded


# probing: an e8m7 (bfloat16-like) FloatFormat was accepted, and its subnormal step
# 2 ** (min_exp - mbits) = 2 ** -133 is no normal float32: small inputs came out NaN or 0
@pytest.mark.parametrize("args,match", [
    (("bf16like", 8, 7, 3.3895313892515355e38),
     r"FloatFormat 'bf16like': .*2 \*\* -133 .*must be a normal float32"),
    (("e9m0", 9, 0, 1.0), r"2 \*\* -254 .*normal float32"),
    (("e0m3", 0, 3, 1.0), r"need ebits >= 1 and mbits >= 0"),
    (("e2m-1", 2, -1, 1.0), r"need ebits >= 1 and mbits >= 0"),
    (("x", 2.0, 1, 6.0), r"FloatFormat\.ebits must be an integer"),
    (("x", 2, True, 6.0), r"FloatFormat\.mbits must be an integer"),
    (("x", 2, 1, 0.0), r"FloatFormat\.max must be a positive finite number"),
    (("x", 2, 1, float("inf")), r"FloatFormat\.max must be a positive finite number"),
    (("x", 8, 0, 2.0 ** 128), r"FloatFormat\.max must be a positive finite number float32"),
    (("x", 2, 1, float("nan")), r"FloatFormat\.max must be a positive finite number"),
])
def test_float_format_outside_the_roundings_construction_raises(args, match):
    with pytest.raises(ValueError, match=match):
        FloatFormat(*args)


@pytest.mark.parametrize("ebits, mbits", [(7, 3), (8, 0), (6, 9)])
def test_float_formats_at_the_edge_round_to_their_table(ebits, mbits):
    """min_exp - mbits = -65, -126 and -39: still built, and every value (subnormals down to
    the smallest step included) maps to itself, every midpoint to its even neighbour (with
    mbits 0 every mantissa field is 0: no tie rule to check)."""
    f = FloatFormat(f"e{ebits}m{mbits}", ebits, mbits, 2.0 ** (2 ** (ebits - 1) - 1))
    values, even = value_table(f)
    values, even = values[: values.index(f.max) + 1], even[: values.index(f.max) + 1]
    t = torch.tensor(values)
    assert t[1].item() == 2.0 ** (1 - f.bias - mbits) > 0  # the smallest step, exact
    assert torch.equal(f.round(torch.cat([t, -t])), torch.cat([t, -t]))
    lo, hi = t[:-1], t[1:]
    expect = torch.where(torch.tensor(even[:-1]), lo, hi)
    assert mbits == 0 or torch.equal(f.round((lo + hi) / 2), expect)
