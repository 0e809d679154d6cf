"""``qparams_from_range(..., shape=)`` and ``Observer.range_and_qparams(shape)``: the qparams
made in the shape a caller reshapes them to (an observer's layout shape, a compat class's
own), bit for bit the reshaped qparams of the default call, by the C kernels with no view
after and, where no kernel runs, reshaped; the integer kernel's constants made once per spec
(no tensor per call). The code before took no ``shape`` and made a float64 tensor of the
constants on every call."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames

from quantscope import Channel, Group, QuantSpec, kernels
from quantscope import qparams as Q
from quantscope.observers import StaticMinMaxObserver
from quantscope.observers.minmax import PlaceholderObserver
from quantscope.presets import MXFP4, NVFP4

SPECS = [QuantSpec("int8"), QuantSpec("uint4", symmetric=False), QuantSpec("fp8_e4m3"),
         MXFP4, NVFP4, QuantSpec("int8", scale="pow2"), QuantSpec("int4", scale="fp16")]


def ranges(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -torch.rand(n, generator=g) * 3, torch.rand(n, generator=g) * 5
    lo[0] = hi[0] = 0.0  # an all-zero unit
    return lo, hi


def same(a, b):
    for x, y in ((a.scale, b.scale), (a.zero_point, b.zero_point),
                 (a.global_scale, b.global_scale)):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("shape", [(12,), (3, 4), (2, 1, 6), (-1, 4), (1, 12, 1)], ids=str)
@pytest.mark.parametrize("check", [True, False])
def test_shape_is_the_reshape_of_the_default(spec, shape, check):
    lo, hi = ranges(12)
    want = Q.qparams_from_range(lo, hi, spec, check_finite=check).reshape(shape)
    same(Q.qparams_from_range(lo, hi, spec, check_finite=check, shape=shape), want)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_one_unit_to_zero_dim(spec):
    lo, hi = ranges(1)
    lo[0] = -2.5
    same(Q.qparams_from_range(lo, hi, spec, shape=()),
         Q.qparams_from_range(lo, hi, spec).reshape(()))


def test_a_shape_of_other_size_is_the_reshapes_error():
    lo, hi = ranges(12)
    with pytest.raises(RuntimeError, match="invalid for input of size 12"):
        Q.qparams_from_range(lo, hi, QuantSpec("int8"), shape=(5,))


@pytest.mark.skipif(not kernels.available("int_qparams"), reason="no compiled kernel")
def test_the_kernel_makes_them_in_the_shape():
    """Two outputs, no view, no tensor of constants."""
    lo, hi = ranges(12)
    Q.qparams_from_range(lo, hi, QuantSpec("int8"), shape=(3, 4))
    with OpNames() as mode:
        qp = Q.qparams_from_range(lo, hi, QuantSpec("int8"), shape=(3, 4))
    assert mode.order == ["aten.empty.memory_format"] * 2 and qp.scale.shape == (3, 4)


@pytest.mark.parametrize("spec", [MXFP4, NVFP4], ids=str)
def test_the_block_kernel_makes_them_in_the_shape(spec):
    """The E8M0 / fp8-block kernel (Quark's MX / block classes pass shape=) too: its outputs
    made in the caller's shape, no view of a flat result."""
    if kernels.lib("block_qparams") is None:
        pytest.skip("no C kernel")
    lo, hi = ranges(12)
    qp = Q.qparams_from_range(lo, hi, spec, shape=(3, 4))
    assert qp.scale.shape == qp.zero_point.shape == (3, 4)
    assert qp.scale._base is None and qp.zero_point._base is None


def test_constants_once_per_spec_object(monkeypatch):
    # the cache is the process's: an empty one of the test's own, so earlier tests' entries
    # do not move where it starts over (and this test leaves the process's as it was)
    monkeypatch.setattr(Q, "_consts", {})
    spec, twin = QuantSpec("int4", symmetric=False), QuantSpec("int4", symmetric=False)
    a = Q._int_consts(spec)
    assert a is Q._int_consts(spec) and list(a) == Q._affine_consts(spec)
    assert list(Q._int_consts(twin)) == list(a)
    assert Q._int_consts(QuantSpec("int4", symmetric=False, eps=1e-3))[2] == pytest.approx(1e-3)
    assert Q._int_consts(MXFP4) is None  # no integer branch: the block kernel's
    specs = [QuantSpec(f"int{2 + i % 7}", symmetric=bool(i % 2)) for i in range(70)]
    for s in specs:  # past the cache's bound (64 objects): it starts over, the values stay
        assert list(Q._int_consts(s)) == Q._affine_consts(s)
    assert len(Q._consts) == 4 + 70 - 64  # 74 spec objects: cleared once, at the 65th


@pytest.mark.parametrize("layout", [Channel(0), Group(16)], ids=str)
def test_observer_range_and_qparams_shape(layout):
    obs = StaticMinMaxObserver(QuantSpec("int8", layout))
    obs(torch.randn(8, 64))
    lo, hi, qp = obs.range_and_qparams()
    lo2, hi2, flat = obs.range_and_qparams((-1,))
    assert lo2 is lo and hi2 is hi and qp.scale.shape == layout.qparam_shape((8, 64))
    same(flat, qp.reshape(-1))


def test_placeholder_range_and_qparams_shape():
    """PlaceholderObserver's fixed qparams honour the base class's ``shape`` too."""
    obs = PlaceholderObserver(QuantSpec("int8", Channel(0)))
    obs(torch.randn(8, 64))
    _, _, qp = obs.range_and_qparams()
    _, _, shaped = obs.range_and_qparams((2, 4))
    assert shaped.scale.shape == shaped.zero_point.shape == (2, 4)
    same(shaped, qp.reshape(2, 4))
