"""kernels/csrc/qs_qparams.h, the kernels' copy of qparams_from_range's integer branch, against the
one in quantscope.qparams, bit for bit."""

import ctypes
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantscope as qs
from quantscope import kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64
_F32 = st.floats(allow_nan=False, allow_infinity=False, width=32)

SPECS = [qs.QuantSpec("uint8", symmetric=False), qs.QuantSpec("int8"),
         qs.QuantSpec("int8", symmetric=False), qs.QuantSpec("uint8"),
         qs.QuantSpec("int4", symmetric=False), qs.QuantSpec("int8_narrow"),
         qs.QuantSpec("uint4", symmetric=False, eps=1e-3),
         qs.QuantSpec("uint8", symmetric=False, quant_min=0, quant_max=127),
         qs.QuantSpec("int16", symmetric=False)]


def _lib():
    lib = kernels.load("qparams_test", {"qs_qparams_all": [_P] * 5 + [_I]},
                       source=Path(__file__).with_name("csrc") / "qparams_test.c")
    if lib is None:
        pytest.skip("no C compiler")
    return lib


def _check(spec, lo, hi):
    consts = kernels.qparams_consts(spec)
    assert consts is not None
    q = torch.tensor(consts, dtype=torch.float64)
    s, z = torch.empty_like(lo), torch.empty_like(lo)
    _lib().qs_qparams_all(lo.data_ptr(), hi.data_ptr(), q.data_ptr(), s.data_ptr(),
                          z.data_ptr(), lo.numel())
    ref = qs.qparams_from_range(lo, hi, spec)
    assert torch.equal(s, ref.effective_scale.float())
    assert torch.equal(z, ref.zero_point.float())


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_c_qparams_equal_qparams_from_range(spec):
    g = torch.Generator().manual_seed(3)
    lo = torch.cat([-torch.rand(2000, generator=g) * 10 ** torch.randint(-8, 8, (2000,),
                                                                        generator=g),
                    torch.tensor([0.0, -0.0, 0.0, 1.0, -3e38, -3.4e38, -1e-30, 2.0])])
    hi = torch.cat([torch.rand(2000, generator=g) * 10 ** torch.randint(-8, 8, (2000,),
                                                                       generator=g),
                    torch.tensor([0.0, 0.0, 1e-20, 3.0, 3e38, 3.4e38, 1e-30, 5.0])])
    _check(spec, lo, hi)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SPECS), st.lists(st.tuples(
    _F32, _F32), min_size=1,
    max_size=20))
def test_c_qparams_property(spec, pairs):
    lo = torch.tensor([min(a, b) for a, b in pairs], dtype=torch.float32)
    hi = torch.tensor([max(a, b) for a, b in pairs], dtype=torch.float32)
    _check(spec, lo, hi)


def test_qparams_consts_only_for_integer_formats_with_fp32_scales():
    assert kernels.qparams_consts(qs.QuantSpec("fp8_e4m3")) is None
    assert kernels.qparams_consts(qs.QuantSpec("int8", scale="pow2")) is None
    assert kernels.qparams_consts(qs.QuantSpec("uint8")) == [0.0, 255.0, qs.QuantSpec().min_scale,
                                                             1.0, 128.0]


@pytest.mark.parametrize("n", [1, 5, (1 << 14) + 3])  # a scalar tail alone, the vector loop
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_cpu_ranges_take_the_kernel_and_equal_the_torch_branch(spec, n, monkeypatch):
    """qparams_from_range on float32 CPU ranges runs csrc/int_qparams.c."""
    from quantscope import qparams as qp_mod

    if kernels.lib("int_qparams") is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(5)
    lo = -torch.rand(n, generator=g) * 10 ** torch.randint(-8, 8, (n,), generator=g)
    hi = torch.rand(n, generator=g) * 10 ** torch.randint(-8, 8, (n,), generator=g)
    k = min(n, 4)  # zeros, the largest and a tiny range first
    lo[:k] = torch.tensor([0.0, -0.0, -3.4e38, -1e-30])[:k]
    hi[:k] = torch.tensor([0.0, 0.0, 3.4e38, 1e-30])[:k]
    calls = []
    monkeypatch.setattr(qp_mod, "_int_qparams_kernel",
                        lambda *a, f=qp_mod._int_qparams_kernel: calls.append(1) or f(*a))
    got = qs.qparams_from_range(lo, hi, spec)
    assert calls
    monkeypatch.setattr(qp_mod, "_int_qparams_kernel", lambda *a: None)  # the torch branch
    ref = qs.qparams_from_range(lo, hi, spec)
    assert got.scale.dtype == ref.scale.dtype and got.zero_point.dtype == ref.zero_point.dtype
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.zero_point, ref.zero_point)
    # a NaN among them: the torch branch's error, as before
    lo[n // 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        qs.qparams_from_range(lo, hi, spec)


def test_backend_vocabulary():
    # one vocabulary for every kernel choice: None (the kernel where it applies), "torch",
    # "kernel" (or an error saying why not)
    assert kernels.choose("torch", "hist_error", "f") is None
    assert kernels.choose(None, "hist_error", "f", applies=False) is None
    with pytest.raises(ValueError, match="f: backend must be one of"):
        kernels.choose("c", "hist_error", "f")
    with pytest.raises(ValueError, match="does not take these inputs"):
        kernels.choose("kernel", "hist_error", "f", applies=False)
    if kernels.available("hist_error"):
        assert kernels.choose("kernel", "hist_error", "f") is kernels.lib("hist_error")
        assert kernels.choose(None, "hist_error", "f") is kernels.lib("hist_error")


def test_backend_kernel_refuses_inputs_the_kernel_does_not_take():
    from quantscope.estimators.entropy import entropy_divergences
    from quantscope.estimators.l2 import l2_range
    from quantscope.stats.histogram import Hist

    counts = torch.ones(1, 256, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="entropy_divergences: backend='kernel'"):
        entropy_divergences(counts, backend="kernel")
    h = Hist(counts, torch.zeros(1, device="meta"), torch.ones(1, device="meta"), False)
    with pytest.raises(ValueError, match="l2_range: backend='kernel'"):
        l2_range(h, backend="kernel")
