"""Pins from session 66's mutation round of quantscope.qparams (qparams_from_range, QParams and
the qparams ops): behaviour that a mutant broke while every test covering the module passed,
or that the tests held only by comparing the C kernel with the torch branch. Expected values
come from the module's docstrings and formulas (zero points rounded half to even and clamped
into the codes, the unsigned upper-midpoint zero point, float32 / int32 results, NVFP4's
``amax / format_max * global_scale``), not from a run."""

from __future__ import annotations

import pytest
import torch

from quantscope import QuantSpec, presets, qparams
from quantscope.qparams import QParams, qparams_from_range
from quantscope.scales import encode_scale


def test_qparams_reads_only_float8_tensors_as_float32():
    """float8 scales and zero points are widened (torch does no float8 arithmetic); a float16
    scale and an int8 / uint8 zero point (one byte, not floating) keep their dtype."""
    q = QParams(torch.ones(2, dtype=torch.float16), torch.zeros(2, dtype=torch.int8),
                torch.ones(1, dtype=torch.float8_e4m3fn))
    assert q.scale.dtype == torch.float16 and q.zero_point.dtype == torch.int8
    assert q.global_scale.dtype == torch.float32
    u = QParams(torch.ones(2, dtype=torch.bfloat16), torch.full((2,), 128, dtype=torch.uint8))
    assert u.scale.dtype == torch.bfloat16 and u.zero_point.dtype == torch.uint8
    assert u.zero_point.tolist() == [128, 128]


def test_qparams_equality_is_identity_and_they_hash():
    a = QParams(torch.tensor([0.5]), torch.tensor([0], dtype=torch.int32))
    b = QParams(a.scale, a.zero_point)
    assert a != b
    assert len({a, b}) == 2


def test_to_casts_zero_point_and_global_scale_too():
    """``.to(dtype)``: "a dtype casts all three"."""
    q = qparams_from_range(-torch.ones(4), torch.ones(4), presets.NVFP4)
    d = q.to(torch.float64)
    assert d.scale.dtype == d.zero_point.dtype == d.global_scale.dtype == torch.float64
    assert torch.equal(d.global_scale, q.global_scale.double())


def test_reshape_keeps_the_global_scale():
    q = qparams_from_range(-torch.ones(6), torch.ones(6), presets.NVFP4)
    r = q.reshape(2, 3)
    assert r.scale.shape == (2, 3) and r.global_scale is q.global_scale
    assert torch.equal(r.effective_scale, (q.scale / q.global_scale).reshape(2, 3))


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int8", scale="bf16"),
                                  presets.MXFP8, presets.NVFP4], ids=str)
def test_float64_ranges_give_float32_scales_and_int32_zero_points(spec):
    lo = torch.tensor([-1.0, -0.25], dtype=torch.float64)
    q = qparams_from_range(lo, -lo, spec)
    assert q.scale.dtype == torch.float32 and q.zero_point.dtype == torch.int32
    assert torch.equal(q.scale, qparams_from_range(lo.float(), -lo.float(), spec).scale)


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int8", scale="pow2"),
                                  QuantSpec("uint8", scale="fp16"), presets.MXFP4,
                                  presets.NVFP4], ids=str)
def test_unchecked_torch_branch_zero_points_are_int32(spec):
    """Below KERNEL_MIN_UNITS an unchecked MX / NVFP4 call and every non-fp32 encoding run
    the torch branch: its zero points are int32 as the kernels'."""
    q = qparams_from_range(-torch.ones(3), torch.ones(3), spec, check_finite=False)
    assert q.zero_point.dtype == torch.int32 and q.scale.dtype == torch.float32


@pytest.mark.parametrize(("spec", "grad"), [(QuantSpec("int8"), [0.0, 1 / 127.5]),
                                           (QuantSpec("int8", symmetric=False), [1 / 255] * 2)],
                         ids=["int8", "int8-asym"])
def test_ranges_that_require_grad_give_a_scale_with_the_formulas_gradient(spec, grad):
    """The C kernels skip ranges that require grad: the torch branch's scale carries the
    formula's gradient (symmetric: d(amax / 127.5) / d hi where hi is the amax, asymmetric:
    d((hi - lo) / 255) / d hi)."""
    hi = torch.tensor([0.5, 2.0], requires_grad=True)
    q = qparams_from_range(torch.tensor([-1.0, -0.5]), hi, spec)
    q.scale.sum().backward()
    assert hi.grad.tolist() == pytest.approx(grad, rel=1e-6)


def test_nvfp4_ranges_that_require_grad_give_scales_that_require_grad():
    hi = torch.tensor([0.5, 2.0], requires_grad=True)
    q = qparams_from_range(torch.tensor([-1.0, -0.5]), hi, presets.NVFP4)
    assert q.scale.requires_grad and q.global_scale.requires_grad


def test_the_ops_branches_leave_ranges_that_require_grad_to_torch():
    """Off the CPU the ops have no gradient (they refuse an input that requires grad): the
    op branches give None for such ranges, and the torch branch computes them."""
    lo = torch.tensor([-1.0, -0.5], requires_grad=True)
    hi = torch.tensor([0.5, 2.0])
    for spec in (QuantSpec("int8"), QuantSpec("fp8_e4m3")):
        assert qparams._int_qparams_op(lo, hi, spec) is None
        assert qparams._int_qparams_op(lo.detach(), hi, spec) is not None
    for spec in (presets.MXFP4, presets.NVFP4):
        assert qparams._block_qparams_op(lo, hi, spec, None) is None
        assert qparams._block_qparams_op(lo.detach(), hi, spec, None) is not None


def test_the_nvfp4_global_scale_is_one_value_of_shape_1_on_meta():
    lo = torch.zeros(32, device="meta")
    q = qparams_from_range(lo, lo, presets.NVFP4, check_finite=False)
    assert q.global_scale.shape == (1,) and q.scale.shape == (32,)


def test_a_0d_nvfp4_range_keeps_its_shape_on_the_torch_branch():
    """"The block scales keep amax's shape (0-d included, as the kernels')"."""
    for check in (True, False):
        q = qparams_from_range(torch.tensor(-3.0), torch.tensor(1.0), presets.NVFP4,
                               check_finite=check)
        assert q.scale.shape == () and q.global_scale.shape == (1,)
        assert q.scale.item() == 448.0  # the unit holding the tensor's amax: e4m3's max


@pytest.mark.parametrize("scale", ["fp16", "bf16", "pow2"])
def test_unsigned_symmetric_zero_point_is_the_upper_midpoint(scale):
    """Symmetric unsigned: ``(qmin + qmax + 1) // 2``: 128 for uint8, 8 for uint4, 64 for
    codes [0, 127] (torch.ao takes the lower one there), on the torch branch too."""
    for fmt, qmax, zp in (("uint8", None, 128), ("uint4", None, 8), ("uint8", 127, 64)):
        spec = QuantSpec(fmt, scale=scale, quant_min=0 if qmax else None, quant_max=qmax)
        q = qparams_from_range(-torch.ones(2), torch.ones(2), spec)
        assert q.zero_point.tolist() == [zp, zp], (fmt, qmax)


@pytest.mark.parametrize("scale", ["fp16", "bf16", "pow2", "fp32"])
def test_asymmetric_zero_point_rounds_half_to_even(scale):
    """A scale 2 ** -4 (stored exactly in every encoding) and ``lo = -2.5`` or ``-3.5``
    steps: ``round(-128 + 2.5) = -126`` and ``round(-128 + 3.5) = -124`` (half to even;
    half up gives -125 and -124)."""
    s = 2.0 ** -4
    lo = torch.tensor([-2.5 * s, -3.5 * s, -1.5 * s])
    spec = QuantSpec("int8", symmetric=False, scale=scale)
    q = qparams_from_range(lo, lo + 255 * s, spec)
    assert q.scale.tolist() == [s, s, s]
    assert q.zero_point.tolist() == [-126, -124, -126]


@pytest.mark.parametrize("scale", ["pow2:floor", "fp32"])
def test_asymmetric_zero_point_is_clamped_into_the_codes(scale):
    """``[-1, 0]`` with a pow2:floor scale (``2 ** -8 < 1 / 255``): ``round(-128 + 256)`` =
    128 is past qmax, clamped to 127; fp32 gives 127 exactly."""
    spec = QuantSpec("int8", symmetric=False, scale=scale)
    q = qparams_from_range(torch.tensor([-1.0, -3.0]), torch.tensor([0.0, 0.0]), spec)
    assert q.zero_point.tolist() == [127, 127]
    if scale == "pow2:floor":
        assert q.scale.tolist() == [2.0 ** -8, 2.0 ** -7]


@pytest.mark.parametrize("scale", ["bf16", "pow2"])
def test_asymmetric_range_near_float32_max_on_the_torch_branch(scale):
    """``hi - lo`` overflows float32: the scale is ``hi / 255 - lo / 255`` there too (then
    stored in the encoding), not inf, and the zero point is computed from it."""
    lo, hi = torch.tensor([-3.4e38, -1.0]), torch.tensor([3.4e38, 1.0])
    spec = QuantSpec("int8", symmetric=False, scale=scale)
    q = qparams_from_range(lo, hi, spec)
    want = encode_scale(hi / 255 - lo / 255, spec.scale)
    assert torch.isfinite(want).all() and torch.equal(q.scale, want)
    assert torch.equal(q.zero_point, torch.round(-128 - lo / want).clamp(-128, 127).int())


@pytest.mark.parametrize("check", [True, False])
def test_nvfp4_block_scale_divides_by_the_format_max_before_the_global_scale(check):
    """``encode(amax / format_max * global_scale)`` in that order, on the C kernel (checked)
    and the torch branch (unchecked, one unit) alike: a block amax whose product lands on an
    e4m3 tie after ``amax / 6`` (the order ``amax * global / 6`` rounds the other way)."""
    amax = torch.tensor([0.013253347016870975])
    gs = 448.0 * 6 / torch.tensor(5.0)  # compressed-tensors' generate_gparam expression
    q = qparams_from_range(-amax, amax, presets.NVFP4, global_amax=torch.tensor(5.0),
                           check_finite=check)
    want = (amax / 6 * gs).to(torch.float8_e4m3fn).float()
    assert torch.equal(q.global_scale, gs.reshape(1)) and torch.equal(q.scale, want)
    assert not torch.equal(want, (amax * gs / 6).to(torch.float8_e4m3fn).float())
