"""The functional API refuses what it cannot run with a named error (probe s14/functional):
a spec that is not a QuantSpec, qparams shaped for another layout, a global scale of more
than one value, qparams fields of the wrong type, complex input, and ``lo > hi``."""

import pytest
import torch

from quantscope import (
    QParams,
    QuantSpec,
    dequantize,
    fake_quantize,
    get_observer,
    qparams_from_range,
    quantize,
)

QP = QParams(torch.tensor([0.1]), torch.tensor([0], dtype=torch.int32))
NVFP4 = QuantSpec("fp4", "block:16", scale="fp8_e4m3")


def _observed(spec, x):
    obs = get_observer("memoryless_minmax", spec)
    obs(x)
    return obs.calculate_qparams()


@pytest.mark.parametrize("spec", ["int8", None, {"format": "int8"}])
@pytest.mark.parametrize("call", [
    lambda s: fake_quantize(torch.randn(4, 8), QP, s),
    lambda s: quantize(torch.randn(4, 8), QP, s, check=False),
    lambda s: dequantize(torch.randn(4, 8), QP, s),
    lambda s: qparams_from_range(torch.tensor(-1.0), torch.tensor(1.0), s),
])
def test_spec_not_a_quantspec_is_a_type_error(call, spec):
    with pytest.raises(TypeError, match="spec must be a QuantSpec, got"):
        call(spec)


@pytest.mark.parametrize("check", [True, False])
def test_qparams_of_another_layout_are_refused(check):
    w = torch.randn(8, 8)
    rows = _observed(QuantSpec("int8", "channel:0"), w)  # (8, 1)
    with pytest.raises(ValueError, match=r"qparams.scale must have shape \(1, 8\).*got \(8, 1\)"):
        fake_quantize(w, rows, QuantSpec("int8", "channel:1"), check=check)
    g = QuantSpec("int4", "group:4")
    x = torch.randn(4, 8)
    q = _observed(g, x)  # (4, 2)
    with pytest.raises(ValueError, match=r"qparams.scale must have shape \(4, 2\)"):
        quantize(x, QParams(q.scale.reshape(2, 4), q.zero_point), g, check=check)
    with pytest.raises(ValueError, match=r"qparams.zero_point must have shape \(4, 2\)"):
        dequantize(x, QParams(q.scale, q.zero_point.reshape(2, 4)), g, check=check)


@pytest.mark.parametrize(("theirs", "ours"), [("channel:1", "channel:0"), ("channel:-1", "token")])
@pytest.mark.parametrize("check", [True, False])
def test_a_row_of_scales_is_not_taken_as_the_flat_form(theirs, ours, check):
    """Probe s23/layouts: on a square tensor (1, 4) scales (one a column) passed for a layout
    of (4, 1) were taken as the flat (4,) form and applied per row."""
    x = torch.randn(4, 4)
    q = _observed(QuantSpec("int8", theirs), x)
    assert tuple(q.scale.shape) == (1, 4)
    with pytest.raises(ValueError, match=r"qparams.scale must have shape \(4, 1\).*got \(1, 4\)"):
        fake_quantize(x, q, QuantSpec("int8", ours), check=check)
    # an activation's (1, 1, C) scales still run on its [B, T, C] rows
    a = torch.randn(2, 3, 4)
    per_channel = QuantSpec("int8", "channel:-1")
    q = _observed(per_channel, a)
    lifted = QParams(q.scale.reshape(1, 1, 4), q.zero_point.reshape(1, 1, 4))
    assert torch.equal(fake_quantize(a, lifted, per_channel), fake_quantize(a, q, per_channel))


def test_layout_and_flat_qparams_still_run():
    g = QuantSpec("int4", "group:4")
    x = torch.randn(4, 8)
    q = _observed(g, x)
    flat = QParams(q.scale.reshape(-1), q.zero_point.reshape(-1))
    assert torch.equal(fake_quantize(x, q, g), fake_quantize(x, flat, g))
    # one unit: any shape of one value (a 0-d scale) has no order to mistake
    t = QuantSpec("int8")
    one = QParams(torch.tensor(0.1), torch.tensor(0, dtype=torch.int32))
    assert torch.equal(fake_quantize(x, one, t), fake_quantize(x, QP, t))


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("size", [2, 3])
def test_global_scale_of_more_than_one_value_is_refused(size, check):
    x = torch.randn(4, 32)
    q = _observed(NVFP4, x)
    gs = q.global_scale.repeat(size)
    with pytest.raises(ValueError, match=r"qparams.global_scale must have one value"):
        fake_quantize(x, QParams(q.scale, q.zero_point, gs), NVFP4, check=check)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize(("qp", "name"), [
    (QParams(torch.tensor([0.1]), None), "zero_point"),
    (QParams(0.1, torch.tensor([0])), "scale"),
    (QParams(torch.tensor([0.1 + 0j]), torch.tensor([0])), "scale"),
    (QParams(torch.tensor([0.1]), torch.tensor([0j])), "zero_point"),
])
def test_qparams_fields_of_the_wrong_type_are_named(qp, name, check):
    with pytest.raises(TypeError, match=rf"qparams.{name} must be a real torch.Tensor"):
        fake_quantize(torch.randn(4, 8), qp, QuantSpec(), check=check)


def test_complex_codes_and_ranges_are_refused():
    with pytest.raises(TypeError, match="dequantize: q must be a real tensor"):
        dequantize(torch.tensor([3 + 100j, -2 + 5j]), QP, QuantSpec())
    for lo, hi in [(torch.tensor([-1 - 1000j]), torch.tensor([1.0])),
                   (torch.tensor([-1.0]), torch.tensor([1 + 1000j]))]:
        with pytest.raises(TypeError, match="qparams_from_range: (lo|hi) must be a real"):
            qparams_from_range(lo, hi, QuantSpec(), check_finite=False)


@pytest.mark.parametrize("spec", [QuantSpec("int8", symmetric=False), QuantSpec("int8"),
                                  QuantSpec("fp8_e4m3"), NVFP4])
def test_lo_above_hi_is_refused_when_checked(spec):
    lo, hi = torch.tensor([-1.0, 2.0]), torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="lo must be <= hi"):
        qparams_from_range(lo, hi, spec)
    qparams_from_range(lo, hi, spec, check_finite=False)  # the hot path reads nothing back
    qparams_from_range(hi.clamp(min=-1), hi.clamp(min=-1), spec)  # lo == hi is a range


def test_lo_above_hi_on_the_c_kernels_path():
    # past KERNEL_MIN_UNITS the block branches run in C before the torch checks
    lo = torch.zeros(1 << 14)
    hi = torch.ones(1 << 14)
    lo[5] = 2.0
    for spec in (NVFP4, QuantSpec("int8", symmetric=False)):
        with pytest.raises(ValueError, match="lo must be <= hi"):
            qparams_from_range(lo, hi, spec)


def test_nan_range_is_still_named_before_order():
    with pytest.raises(ValueError, match="must be finite"):
        qparams_from_range(torch.tensor([float("nan")]), torch.tensor([1.0]), QuantSpec())
