"""compat.quark's block observers against Quark 0.13 where probe s39 found them apart:
``PerBlockBFPObserver`` priced the qspec's dtype (Quark's never reads it: BFP16 always);
``PerBlockMXObserver(qspec, device, eps)`` with e4m3 block scales took ``eps`` into the spec
(any eps not an e4m3 value raised; Quark's e4m3 path never reads it); a static block observer
merged a batch of another shape with the same ``(rows, blocks)`` in native unit order, not
Quark's row order; and a NaN / inf range given to ``calculate_qparams(min_val, max_val)``
gave NaN scales (float) or an error naming nothing (int)."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope.compat import quark


def _twins(name, **kw):
    qo = pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType

    c = QTensorConfig(dtype=Dtype(kw.pop("dtype")), qscheme=QSchemeType(kw.pop("qscheme")),
                      round_method=RoundType.half_even, scale_type=ScaleType.float,
                      observer_cls=getattr(quark, name), **kw)
    return getattr(qo, name), getattr(quark, name), c


def _equal(a, b):
    assert a.shape == b.shape and torch.equal(a.float(), b.float()), (a, b)


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("dtype", ["fp4", "fp8_e4m3", "int4", "int8", "bfp16"])
def test_bfp_observer_is_bfp16_whatever_the_dtype(dtype):
    theirs, ours, c = _twins("PerBlockBFPObserver", dtype=dtype, qscheme="per_group",
                             group_size=8, ch_axis=-1, is_dynamic=True, symmetric=True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 3
    t, o = theirs(c), ours(c)
    t(x), o(x)
    _equal(o._calculate_qparams()[0], t.calculate_qparams()[0])


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("eps", [1e-3, 1e-5, 2.0 ** -9, 0.01])
def test_mx_e4m3_scales_ignore_eps(eps):
    theirs, ours, c = _twins("PerBlockMXObserver", dtype="fp4", qscheme="per_group",
                             group_size=32, ch_axis=-1, scale_format="e4m3")
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0
    t, o = theirs(c, None, eps), ours(c, None, eps)
    t(x), o(x)
    _equal(o._calculate_qparams()[0], t._calculate_qparams()[0])


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("name,kw,shapes", [
    ("PerBlockMXObserver", {"dtype": "fp4", "scale_format": "e8m0", "group_size": 8,
                            "ch_axis": 0}, [(64, 4), (64, 2, 2)]),
    ("PerBlockMXObserver", {"dtype": "fp4", "scale_format": "e8m0", "group_size": 8,
                            "ch_axis": 0}, [(8, 6), (8, 3, 2)]),
    ("PerBlockBFPObserver", {"dtype": "bfp16", "group_size": 8, "ch_axis": 0},
     [(64, 4), (64, 2, 2)]),
])
def test_a_static_block_observer_merges_rows_in_quarks_order(name, kw, shapes):
    theirs, ours, c = _twins(name, qscheme="per_group", is_dynamic=False, **kw)
    t, o = theirs(c), ours(c)
    g = torch.Generator().manual_seed(2)
    for shape in shapes:
        x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 8
        t(x), o(x)
    if name == "PerBlockMXObserver":  # (BFP16's amax: Quark's doubles where a block
        _equal(o.amax, t.amax)  # overflows, documented; its scales are the same)
    _equal(o._calculate_qparams()[0], t._calculate_qparams()[0])


@pytest.mark.parametrize("name,qspec", [
    ("PerTensorMinMaxObserver", {"dtype": "int8"}),
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerChannelMinMaxObserver", {"dtype": "fp8_e4m3", "qscheme": "per_channel",
                                  "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 4}),
])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_given_non_finite_range_is_refused_by_name(name, qspec, bad):
    obs = getattr(quark, name)({"symmetric": True, **qspec})
    lo, hi = -torch.ones(2, 4), torch.ones(2, 4)
    hi[1, 2] = bad
    with pytest.raises(ValueError, match=rf"{name}.calculate_qparams: max_val holds NaN or inf"):
        obs.calculate_qparams(lo, hi)


def test_a_given_non_finite_min_val_is_refused_by_name():
    obs = quark.PerTensorMinMaxObserver({"dtype": "fp8_e4m3", "symmetric": True})
    lo, hi = -torch.ones(2, 4), torch.ones(2, 4)
    lo[0, 1] = math.nan
    with pytest.raises(ValueError, match="calculate_qparams: min_val holds NaN or inf"):
        obs.calculate_qparams(lo, hi)


def test_a_refused_batch_of_another_shape_leaves_the_state():
    # (reviewer) the rows were laid out for the new shape before the batch was refused
    obs = quark.PerBlockMXObserver({"dtype": "fp4", "scale_format": "e8m0", "group_size": 8,
                                    "ch_axis": 0, "qscheme": "per_group", "is_dynamic": False,
                                    "symmetric": True})
    obs(torch.randn(64, 4, generator=torch.Generator().manual_seed(2)) * 8)
    before = obs.amax.clone()
    with pytest.raises(quark.UnsupportedInputError):
        obs(torch.zeros(64, 2, 2, dtype=torch.bool))
    assert torch.equal(obs.amax, before) and obs.shape == (64, 4)
