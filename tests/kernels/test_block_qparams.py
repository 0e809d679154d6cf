"""qparams_from_range's MX (E8M0) and NVFP4 (fp8 block scale) branches in C
(kernels/csrc/block_qparams.c) against its torch branch, bitwise."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope import QuantSpec, kernels, presets, qparams
from quantscope.layout import Block
from quantscope.qparams import KERNEL_MIN_UNITS, qparams_from_range

needs_kernel = pytest.mark.skipif(kernels.lib("block_qparams") is None, reason="no C kernel")

SPECS = [QuantSpec(fmt, Block(32), scale=f"e8m0:{mode}")
         for fmt in ("fp4_e2m1", "fp8_e4m3", "fp6_e3m2", "int8_narrow", "int4")
         for mode in ("floor", "ceil", "even", "rceil")]  # MXINT8, BFP16: integer elements
SPECS += [QuantSpec("fp4_e2m1", Block(16), scale="fp8_e4m3")]


def _ranges(seed, n):
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** torch.randint(-140, 120, (2, n), generator=g).float()
    lo = -torch.rand(n, generator=g) * mag[0]
    hi = torch.rand(n, generator=g) * mag[1]
    # exact powers of two, their rounding edges, zeros, one-sided and degenerate ranges
    k = n // 8
    hi[:k] = 2.0 ** torch.randint(-130, 100, (k,), generator=g).float()
    hi[k:2 * k] = hi[:k] * 1.75
    hi[2 * k:3 * k] = hi[:k] * (1 + 2.0 ** -24) * 1.5
    lo[3 * k:4 * k] = 0.0
    hi[3 * k:4 * k] = 0.0
    lo[4 * k:5 * k] = lo[4 * k:5 * k] + 5.0
    hi[5 * k:6 * k] = -hi[5 * k:6 * k]
    hi[6 * k] = torch.finfo(torch.float32).max
    # a few float32 subnormals (rceil's amax / max underflows to 0), in the vector loop and
    # in the scalar tail
    for at in (slice(6 * k + 1, 6 * k + 9), slice(n - 3, n)):
        m = at.stop - at.start
        lo[at], hi[at] = -torch.arange(m) * 2.0 ** -149, torch.arange(1, m + 1) * 2.0 ** -149
    # just above max * 2 ** -127 of the specs' formats: rceil's amax / max is a float32
    # subnormal there, which rounded onto 2 ** -127 (the exact scale is 2 ** -126)
    edge = torch.tensor([6.0, 448.0, 28.0, 127.0, 7.0]) * 2.0**-127
    lo[6 * k + 9:6 * k + 19] = 0.0
    hi[6 * k + 9:6 * k + 19] = torch.cat([edge, torch.nextafter(edge, torch.ones(()))])
    return lo, hi


def _torch_branch(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setattr(qparams, "_block_qparams_kernel", lambda *a: None)
        return qparams_from_range(*args, **kw)


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_kernel_equals_the_torch_branch(spec, monkeypatch):
    lo, hi = _ranges(0, 4 * KERNEL_MIN_UNITS)
    for gamax in (None, torch.tensor(3.0), torch.tensor(0.0)):
        if gamax is not None and spec.scale.kind != "fp8_e4m3":
            continue
        # check_finite=False: the ranges include unordered ones (lo > hi), which the checked
        # call refuses and both branches must still treat alike
        got = qparams_from_range(lo, hi, spec, global_amax=gamax, check_finite=False)
        want = _torch_branch(monkeypatch, lo, hi, spec, global_amax=gamax, check_finite=False)
        assert torch.equal(got.scale, want.scale)
        assert torch.equal(got.zero_point, want.zero_point)
        assert (got.global_scale is None) == (want.global_scale is None)
        if got.global_scale is not None:
            assert torch.equal(got.global_scale, want.global_scale)


@needs_kernel
@pytest.mark.parametrize("spec", [presets.MXINT8, presets.BFP16, presets.MXFP4], ids=str)
def test_integer_and_float_elements_take_the_kernel(spec):
    """MXINT8 and BFP16 (E8M0 over integer elements) took the torch branch, 13-63x slower
    than MXFP4's kernel on the same ranges (found by probing)."""
    lo, hi = _ranges(1, KERNEL_MIN_UNITS)
    assert qparams._block_qparams_kernel(lo, hi, spec, None) is not None


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spec=st.sampled_from(SPECS))
def test_kernel_equals_the_torch_branch_on_random_ranges(seed, spec):
    lo, hi = _ranges(seed, KERNEL_MIN_UNITS + 17)
    got = qparams_from_range(lo, hi, spec, check_finite=False)  # unordered ones too
    mp = pytest.MonkeyPatch()
    try:
        want = _torch_branch(mp, lo, hi, spec, check_finite=False)
    finally:
        mp.undo()
    assert torch.equal(got.scale, want.scale) and torch.equal(got.zero_point, want.zero_point)


@needs_kernel
@pytest.mark.parametrize("spec", [s for s in SPECS if s.scale.mode == "rceil"], ids=str)
def test_rceil_of_subnormal_quotients_in_the_scalar_loop(spec, monkeypatch):
    """The scalar loop (fewer than 8 blocks) on amax just above max * 2 ** -127 (a float32
    amax / max rounds onto 2 ** -127 there) and on inf, against the torch branch."""
    edge = spec.format.max * 2.0 ** torch.tensor([-127.0, -128.0, -126.0])
    hi = torch.cat([torch.nextafter(edge, torch.ones(())), torch.tensor([1.0, 3e38])])
    lo = torch.zeros_like(hi)
    got = qparams._block_qparams_kernel(lo, hi, spec, None)
    assert torch.equal(got.scale, _torch_branch(monkeypatch, lo, hi, spec).scale)
    assert got.scale[0] == 2.0**-126


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2], SPECS[-1]], ids=str)
@pytest.mark.parametrize("at", [5, KERNEL_MIN_UNITS + 2])  # the vector loop, the scalar tail
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_ranges_still_raise(spec, at, bad):
    lo, hi = _ranges(1, KERNEL_MIN_UNITS + 3)
    hi[at] = bad
    with pytest.raises(ValueError, match="finite"):
        qparams_from_range(lo, hi, spec)


@needs_kernel
@pytest.mark.parametrize("spec", [SPECS[2], SPECS[-1]], ids=str)
def test_the_kernel_runs_on_many_blocks(spec):
    lo, hi = _ranges(2, KERNEL_MIN_UNITS)
    assert qparams._block_qparams_kernel(lo, hi, spec, None) is not None


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_checked_call_takes_the_kernel_at_any_count(spec, monkeypatch):
    """A checked call reads back anyway: its few blocks run in C too (bitwise the torch
    branch); an unchecked one (an observer's forward) reads nothing back below the
    threshold, so it keeps the torch branch there."""
    calls, kernel = [], qparams._block_qparams_kernel
    monkeypatch.setattr(qparams, "_block_qparams_kernel",
                        lambda *a: calls.append(1) or kernel(*a))
    lo, hi = _ranges(3, 200)  # far below KERNEL_MIN_UNITS
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)  # ordered: the checked call's input
    got = qparams_from_range(lo, hi, spec)
    assert calls == [1]
    want = _torch_branch(monkeypatch, lo, hi, spec)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.zero_point, want.zero_point)
    if got.global_scale is not None:
        assert torch.equal(got.global_scale, want.global_scale)
    qparams_from_range(lo, hi, spec, check_finite=False)
    assert calls == [1]
