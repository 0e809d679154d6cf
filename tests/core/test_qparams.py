"""qparams_from_range: reference values from the formulas, invariants, and never NaN / inf."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope import QParams, QuantSpec, fake_quantize, presets, qparams_from_range
from quantscope.formats import FP4_E2M1, FP8_E4M3
from quantscope.qparams import KERNEL_MIN_UNITS
from quantscope.scales import e8m0_scale

ONES = torch.ones(5)
FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def qp_of(x, spec):
    """qparams of one tensor through its layout (what an observer does)."""
    u = spec.layout.to_units(x.float())
    lo, hi = u.min(1).values, u.max(1).values
    return qparams_from_range(lo, hi, spec).reshape(spec.layout.qparam_shape(x.shape))


@pytest.mark.parametrize("spec,scale,zp", [
    (QuantSpec("int8"), 1 / 127.5, 0),                       # compressed-tensors' own test values
    (QuantSpec("int8", symmetric=False), 1 / 255, -128),
    (QuantSpec("int8_narrow"), 1 / 127, 0),
    (QuantSpec("int4"), 1 / 7.5, 0),
    (QuantSpec("int4", symmetric=False), 1 / 15, -8),
    (QuantSpec("uint8"), 1 / 127.5, 128),                    # torch.ao quint8 symmetric
    (QuantSpec("uint8", symmetric=False), 1 / 255, 0),
    (QuantSpec("int8", quant_min=-64, quant_max=63), 1 / 63.5, 0),  # torch.ao reduce_range
    (QuantSpec("fp8_e4m3"), 1 / 448, 0),
    (QuantSpec("fp8_e5m2"), 1 / 57344, 0),
    (QuantSpec("fp6_e3m2"), 1 / 28, 0),
    (QuantSpec("fp6_e2m3"), 1 / 7.5, 0),
    (QuantSpec("fp4"), 1 / 6, 0),
])
def test_reference_values_for_ones(spec, scale, zp):
    q = qparams_from_range(ONES.min().reshape(1), ONES.max().reshape(1), spec)
    assert q.scale.dtype == torch.float32 and q.zero_point.dtype == torch.int32
    assert q.scale.shape == (1,) and q.global_scale is None
    assert q.scale.item() == pytest.approx(scale, rel=1e-7) and q.zero_point.item() == zp


def test_asymmetric_formula():
    lo, hi = torch.tensor([-3.0, -1.0, 0.5, -2.0]), torch.tensor([1.0, 3.0, 2.0, -0.5])
    q = qparams_from_range(lo, hi, QuantSpec("int8", symmetric=False))
    lo0, hi0 = lo.clamp(max=0), hi.clamp(min=0)  # the range always includes zero
    scale = (hi0 - lo0) / 255
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.zero_point, torch.round(-128 - lo0 / scale).clamp(-128, 127).int())
    assert q.zero_point.tolist() == [63, -64, -128, 127]  # -128 + 191.25, -128 + 63.75, ...


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_zero_is_exact_and_all_zero_units_are_finite(name):
    spec = presets.get(name)
    x = torch.randn(4, 256)
    x[1] = 0  # an all-zero row: all-zero units for every layout
    q = qp_of(x, spec)
    s = q.effective_scale
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (q.zero_point >= spec.qmin).all() and (q.zero_point <= spec.qmax).all()
    out = fake_quantize(x, q, spec)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (out[x == 0] == 0).all()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(presets.PRESETS) + ["pow2", "fp16", "bf16", "uint4-asym"]),
       st.lists(st.tuples(FLOAT32, FLOAT32),
                min_size=1, max_size=6))
def test_never_nan_or_inf(name, pairs):
    spec = {"pow2": QuantSpec("int8", scale="pow2"), "fp16": QuantSpec("int4", scale="fp16"),
            "bf16": QuantSpec("int8", symmetric=False, scale="bf16"),
            "uint4-asym": QuantSpec("uint4", symmetric=False)}.get(name) or presets.get(name)
    lo = torch.tensor([min(a, b) for a, b in pairs])
    hi = torch.tensor([max(a, b) for a, b in pairs])
    q = qparams_from_range(lo, hi, spec)
    s = q.effective_scale
    assert torch.isfinite(s).all() and (s > 0).all(), (lo, hi, s)
    assert (q.zero_point >= spec.qmin).all() and (q.zero_point <= spec.qmax).all()


def test_symmetric_scale_maps_amax_onto_half_the_range():
    g = torch.Generator().manual_seed(0)
    lo, hi = -torch.rand(100, generator=g) * 10, torch.rand(100, generator=g) * 10
    amax = torch.maximum(-lo, hi)
    for spec, div in ((QuantSpec("int8"), 127.5), (QuantSpec("int4_narrow"), 7.0),
                      (QuantSpec("int2"), 1.5), (QuantSpec("fp8"), 448.0)):
        assert torch.equal(qparams_from_range(lo, hi, spec).scale, amax / div)


@pytest.mark.parametrize("enc", ["pow2:round", "pow2:floor", "pow2:ceil", "fp16", "bf16"])
def test_scale_is_stored_in_its_encoding_and_zero_point_uses_the_stored_scale(enc):
    g = torch.Generator().manual_seed(1)
    lo, hi = -torch.rand(200, generator=g) * 5, torch.rand(200, generator=g) * 5
    spec = QuantSpec("int8", symmetric=False, scale=enc)
    q = qparams_from_range(lo, hi, spec)
    if enc.startswith("pow2"):
        assert (torch.frexp(q.scale)[0] == 0.5).all()
        raw = (hi - lo) / 255
        assert {"pow2:floor": (q.scale <= raw), "pow2:ceil": (q.scale >= raw),
                "pow2:round": (q.scale / raw).sub(1).abs() <= 0.5}[enc].all()
    else:
        dtype = torch.float16 if enc == "fp16" else torch.bfloat16
        assert torch.equal(q.scale.to(dtype).float(), q.scale)
    assert torch.equal(q.zero_point, torch.round(-128 - lo / q.scale).clamp(-128, 127).int())


def test_eps_is_the_smallest_scale():
    spec = QuantSpec("int8", eps=1e-3)
    q = qparams_from_range(torch.tensor([0.0, -1e-6, -1.0]), torch.tensor([0.0, 1e-6, 1.0]), spec)
    assert q.scale.tolist() == pytest.approx([1e-3, 1e-3, 1 / 127.5])


def _smallest_stored_at_least(eps: float, scale: str) -> float:
    """By enumeration: every positive value of the 16-bit dtype, or the powers of two."""
    e = torch.tensor(eps, dtype=torch.float32)
    if scale.startswith("pow2"):
        values = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    else:
        dtype = torch.float16 if scale == "fp16" else torch.bfloat16
        values = torch.arange(1, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype).float()
        values = values[values.isfinite()]
    return float(values[values >= e].min())


@pytest.mark.parametrize("scale", ["fp16", "bf16", "pow2:floor", "pow2:round", "pow2:ceil"])
@pytest.mark.parametrize("eps", [1e-3, 8e-8, 0.13 / 127.5, None])
def test_an_encoded_scale_is_at_least_eps(scale, eps):
    """Clamped at eps and then encoded, a scale could round below it (bf16 eps 0.001 ->
    0.000999, pow2:floor of 0.00102 -> 2 ** -10): it is the smallest stored value >= eps."""
    spec = QuantSpec("int8", scale=scale, eps=eps)
    eps32 = float(torch.tensor(spec.min_scale, dtype=torch.float32))
    lo = torch.tensor([0.0, -1e-9, -0.13, -1.0, -3e4])
    q = qparams_from_range(lo, -lo, spec)
    assert (q.scale >= eps32).all()
    floor = _smallest_stored_at_least(spec.min_scale, scale)
    assert q.scale[:2].tolist() == [floor, floor]  # the ranges below eps
    plain = qparams_from_range(lo, -lo, QuantSpec("int8", eps=eps))  # fp32 scales
    from quantscope.scales import encode_scale

    want = torch.maximum(encode_scale(plain.scale, spec.scale), torch.tensor(floor))
    assert torch.equal(q.scale, want)


@pytest.mark.parametrize("spec", [presets.MXFP8, presets.MXFP4, presets.MXFP6_E3M2, presets.MXINT8,
                                  presets.BFP16, presets.MXFP4.replace(scale="e8m0:rceil")],
                         ids=str)
def test_mx_scales_come_from_e8m0(spec):
    g = torch.Generator().manual_seed(2)
    lo, hi = -torch.rand(64, generator=g) * 3, torch.rand(64, generator=g) * 3
    q = qparams_from_range(lo, hi, spec)
    assert torch.equal(q.scale, e8m0_scale(torch.maximum(-lo, hi), spec.format, spec.scale.mode))
    assert (q.zero_point == 0).all() and q.global_scale is None


def test_mxint8_and_bfp16_codes_are_the_int8_mantissas():
    """MXINT8: scale 2**(floor(log2 amax) - 6); BFP16 bumps it when the top code would be 128."""
    amax = torch.tensor([1.0, 1.5, 1.99, 1.9999, 3.0])
    q = qparams_from_range(-amax, amax, presets.MXINT8)
    assert torch.equal(q.scale, torch.exp2(torch.floor(torch.log2(amax)) - 6))
    b = qparams_from_range(-amax, amax, presets.BFP16)
    bumped = torch.round(amax / q.scale) >= 128
    assert torch.equal(b.scale, q.scale * torch.where(bumped, 2.0, 1.0))
    assert bumped.tolist() == [False, False, False, True, False]


def test_nvfp4_global_and_block_scales():
    g = torch.Generator().manual_seed(3)
    amax = torch.rand(64, generator=g) * 4
    amax[5] = 0
    q = qparams_from_range(-amax, amax, presets.NVFP4)
    gs = 448 * 6 / amax.max()
    assert q.global_scale.shape == (1,) and q.global_scale.item() == pytest.approx(gs.item(), rel=1e-7)
    block = (amax / 6 * q.global_scale).to(torch.float8_e4m3fn).float()
    block = torch.where(block > 0, block, torch.full_like(block, 0.125))
    assert torch.equal(q.scale, block)
    assert torch.equal(q.effective_scale, q.scale / q.global_scale)
    # the block holding the tensor's amax gets the largest e4m3 scale
    assert q.scale.max() == FP8_E4M3.max
    # an explicit global amax (the observer's running maximum) is used as given
    q2 = qparams_from_range(-amax, amax, presets.NVFP4, global_amax=torch.tensor(8.0))
    assert q2.global_scale.item() == 448 * 6 / 8
    assert FP4_E2M1.max == 6


def test_errors_and_qparams_helpers():
    with pytest.raises(ValueError, match="lo and hi must have one shape"):
        qparams_from_range(torch.zeros(3), torch.zeros(4), QuantSpec())
    # probing: two values gave a bare RuntimeError from a reshape deep inside
    with pytest.raises(ValueError, match=r"global_amax must be one value .* got shape \(2,\)"):
        qparams_from_range(-torch.ones(2), torch.ones(2), presets.NVFP4,
                           global_amax=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="must be finite"):
        qparams_from_range(torch.tensor([float("nan")]), torch.zeros(1), QuantSpec())
    # an absolute maximum below 0 is no amax (it read as an all-zero tensor's: global scale
    # 1): on the torch branch and on the C one (from KERNEL_MIN_UNITS units)
    for units in (2, KERNEL_MIN_UNITS):
        for bad in (-0.03, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"global_amax must be finite and >= 0"):
                qparams_from_range(-torch.ones(units), torch.ones(units), presets.NVFP4,
                                   global_amax=torch.tensor(bad))
    with pytest.raises(ValueError, match="must be finite"):
        qparams_from_range(torch.zeros(1), torch.tensor([float("inf")]), QuantSpec())
    q = qparams_from_range(-torch.ones(2, 3), torch.ones(2, 3), QuantSpec())
    assert q.scale.shape == (2, 3) and q.reshape(6).scale.shape == (6,)
    scale, zp = q
    assert scale is q.scale and zp is q.zero_point
    assert q.to(torch.float64).scale.dtype == torch.float64
    assert isinstance(q, QParams) and q.effective_scale is q.scale


def test_asymmetric_range_near_float32_max_keeps_its_scale():
    """hi - lo overflows float32: the scale is then computed as hi / n - lo / n."""
    lo, hi = torch.tensor([-3.4e38, -1.0]), torch.tensor([3.4e38, 1.0])
    q = qparams_from_range(lo, hi, QuantSpec("int8", symmetric=False))
    assert torch.isfinite(q.scale).all()
    assert q.scale[0] == hi[0] / 255 - lo[0] / 255 and q.scale[1] == 2 / 255
    assert torch.equal(q.zero_point, torch.round(-128 - lo / q.scale).int())


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec("fp4", "block:32", scale="e8m0")],
                         ids=str)
def test_float64_ranges_past_float32_say_so(spec):
    """probing: a finite float64 range past float32's max read "must be finite (got NaN or
    inf)" (the float32 conversion made it inf); the observers' float32-range message now."""
    lo = torch.tensor([-1e300] + [0.0] * 31, dtype=torch.float64)
    hi = torch.ones(32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"qparams_from_range: float64 values beyond float32's "
                                         r"range .* max \|x\| = 1e\+300"):
        qparams_from_range(lo, hi, spec)
    q = qparams_from_range(lo.clamp(min=-3e38), hi, spec)  # float64 within float32: taken
    assert q.scale.isfinite().all()
