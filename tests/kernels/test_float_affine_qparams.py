"""Float formats under fp32 scales (fp8 per tensor / channel, fp4, fp6 e3m2) take the integer
branch's one-pass paths (the C kernel on the CPU, ``quantscope::int_qparams`` off it: one op
where the torch branch dispatched nine): their formula is ``_affine_qparams``' symmetric one
with zero point 0, bit for bit the torch branch's on each path."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames
from triton_interpreter import fresh_interpreter_test

from quantscope import FloatFormat, QuantSpec, kernels, qparams
from quantscope.layout import Channel

test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

SPECS = [QuantSpec("fp8_e4m3"), QuantSpec("fp8_e5m2", Channel(0)), QuantSpec("fp6_e3m2"),
         QuantSpec("fp4_e2m1"), QuantSpec("fp8_e4m3", eps=1e-3), QuantSpec("fp4_e2m1", eps=1e-30),
         QuantSpec(FloatFormat("fp5_e3m1_custom", 3, 1, 12.0))]


def _ranges(n=3000, seed=0):
    """Ranges over float32's span: subnormal to near its max, zeros, one-sided."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-150, 127, (n,), generator=g)
                                                 .float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-150, 127, (n,), generator=g)
                                                 .float())
    a[:4], b[2:6] = 0.0, 0.0
    a[6], b[6] = -3.4e38, 3.4e38
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    lo[10:20], hi[20:30] = lo[10:20].abs(), -hi[20:30].abs()  # one side of zero
    return torch.minimum(lo, hi), torch.maximum(lo, hi)


def _torch_branch(lo, hi, spec):
    return qparams._scale_qparams(lo.clamp(max=0), hi.clamp(min=0), spec)


def _assert_equal(got, want):
    assert got.scale.dtype == torch.float32 and got.zero_point.dtype == torch.int32
    assert torch.equal(got.scale.cpu(), want.scale)
    assert torch.equal(got.zero_point.cpu(), want.zero_point)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_cpu_paths_are_the_torch_branch(spec):
    lo, hi = _ranges(seed=len(str(spec)))
    want = _torch_branch(lo, hi, spec)
    if kernels.lib("int_qparams") is not None:
        _assert_equal(qparams._int_qparams_kernel(lo, hi, spec), want)
    _assert_equal(qparams.qparams_from_range(lo, hi, spec), want)
    _assert_equal(qparams._int_qparams_op(lo, hi, spec), want)  # the op's CPU implementation


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_triton_op_is_the_torch_branch(device, spec):
    from quantscope.kernels.triton import block_qparams

    lo, hi = _ranges(seed=len(str(spec)) + 1)
    scale, zp = block_qparams.int_qparams(lo.to(device), hi.to(device),
                                          *qparams._affine_consts(spec))
    _assert_equal(qparams.QParams(scale, zp), _torch_branch(lo, hi, spec))


@pytest.mark.parametrize("spec", [QuantSpec("fp8_e4m3"), QuantSpec("fp8_e4m3", Channel(0))],
                         ids=str)
def test_off_the_cpu_fp8_qparams_are_one_op(spec):
    lo, hi = (t[:16].to("meta") for t in _ranges())
    with OpNames() as seen:
        qparams.qparams_from_range(lo, hi, spec, check_finite=False)
    assert [n for n in seen.names if n.startswith("quantscope.")] == ["quantscope.int_qparams"]
    assert sum(seen.calls.values()) <= 2, seen.calls  # was 9 torch ops


def _nan_ranges():
    lo, hi = _ranges(40)
    lo[5], hi[7] = float("nan"), float("nan")
    return lo, hi


def _assert_nan_equal(got, want):
    assert torch.equal(got.scale.cpu().isnan(), want.scale.isnan())
    assert got.scale.isnan().any()
    assert torch.equal(got.scale.cpu().nan_to_num(), want.scale.nan_to_num())
    assert torch.equal(got.zero_point.cpu(), want.zero_point)


def test_nan_ranges_raise_and_unchecked_ones_propagate_as_before():
    spec = QuantSpec("fp8_e4m3")
    lo, hi = _nan_ranges()
    with pytest.raises(ValueError, match="finite"):
        qparams.qparams_from_range(lo, hi, spec)
    want = _torch_branch(lo, hi, spec)
    # the C kernel declines a NaN range (the torch branch computes it), where it is built
    if kernels.lib("int_qparams") is not None:
        assert kernels.lib("int_qparams") and qparams._int_qparams_kernel(lo, hi, spec) is None
        assert qparams._int_qparams_kernel(*_ranges(40), spec) is not None  # (finite: takes)
    _assert_nan_equal(qparams.qparams_from_range(lo, hi, spec, check_finite=False), want)
    _assert_nan_equal(qparams._int_qparams_op(lo, hi, spec), want)  # the op's CPU one


@pytest.mark.parametrize("spec", [QuantSpec("fp8_e4m3"), QuantSpec("fp4_e2m1")], ids=str)
def test_triton_op_propagates_nan_ranges_as_the_torch_branch(device, spec):
    from quantscope.kernels.triton import block_qparams

    lo, hi = _nan_ranges()
    scale, zp = block_qparams.int_qparams(lo.to(device), hi.to(device),
                                          *qparams._affine_consts(spec))
    _assert_nan_equal(qparams.QParams(scale, zp), _torch_branch(lo, hi, spec))
