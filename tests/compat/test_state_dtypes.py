"""compat.quark's state_dict is Quark's: its observers register their statistics (and eps)
non-persistent, so there is nothing to save and nothing to load (``PerTensorHistogramObserverPro``
apart: the native observer's state). Quark keeps no input dtype either: neither do these."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import quark

QSPECS = [
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerTensorMinMaxObserver", {"dtype": "int8"}),
    ("PerGroupMinMaxObserver", {"dtype": "uint4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 8, "symmetric": False}),
    ("PerTensorMSEObserver", {"dtype": "int8"}),
    ("PerBlockBFPObserver", {"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1,
                             "group_size": 8}),
]


def _data(dtype):
    return (torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)


@pytest.mark.parametrize("name, qspec", QSPECS, ids=lambda v: str(v))
def test_state_dict_is_empty_and_a_load_keeps_the_state(name, qspec):
    cls = getattr(quark, name)
    seen = cls(qspec)
    seen(_data(torch.bfloat16))
    assert seen.state_dict() == {}
    before = seen.calculate_qparams()
    seen.load_state_dict({}, strict=True)  # Quark's state: nothing to take
    for a, b in zip(seen.calculate_qparams(), before, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    fresh = cls(qspec)
    fresh.load_state_dict(seen.state_dict(), strict=True)
    assert not fresh.has_observed


def test_a_saved_native_state_is_refused_strictly_and_ignored_otherwise():
    """A state saved by the native observer (or an earlier quantscope) has keys Quark's has
    not: strict loading names them, as torch; non-strict ignores them."""
    from quantscope.observers.minmax import StaticMinMaxObserver

    o = quark.PerTensorMinMaxObserver({"dtype": "int8"})
    native = StaticMinMaxObserver(o.spec)
    native(_data(torch.float32))
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: .*"min_vals"'):
        o.load_state_dict(native.state_dict())
    result = o.load_state_dict(native.state_dict(), strict=False)
    assert "min_vals" in result.unexpected_keys and not o.has_observed


def test_pro_keeps_the_native_state():
    o = quark.PerTensorHistogramObserverPro({"dtype": "int8"})
    o(_data(torch.float32))
    back = quark.PerTensorHistogramObserverPro({"dtype": "int8"})
    back.load_state_dict(o.state_dict(), strict=True)
    for a, b in zip(back.calculate_qparams(), o.calculate_qparams(), strict=True):
        assert torch.equal(a, b)
