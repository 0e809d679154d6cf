"""compat.quark: the input dtype (which sets Quark's scale and min_val dtype) travels with the
state, so a reloaded observer gives the qparams of the one that saw the data, bitwise."""

from __future__ import annotations

import io

import pytest
import torch

from quantscope.compat import quark

QSPECS = [
    ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
    ("PerTensorMinMaxObserver", {"dtype": "fp8_e4m3"}),
    ("PerTensorMinMaxObserver", {"dtype": "int8"}),
    ("PerGroupMinMaxObserver", {"dtype": "uint4", "qscheme": "per_group", "ch_axis": -1,
                                "group_size": 8, "symmetric": False}),
]


def _data(dtype):
    return (torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)


def _reloaded(src):
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
    assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("name, qspec", QSPECS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reloaded_observer_keeps_the_input_dtype(name, qspec, dtype):
    cls = getattr(quark, name)
    seen = cls(qspec)
    seen(_data(dtype))
    back = cls(qspec)  # fresh: it has seen nothing, so it knows no input dtype
    back.load_state_dict(_reloaded(seen))
    for a, b in zip(seen.calculate_qparams(), back.calculate_qparams(), strict=True):
        _same(a, b)
    _same(seen.min_val, back.min_val)
    _same(seen.max_val, back.max_val)


@pytest.mark.parametrize("name, qspec", QSPECS[:2], ids=lambda v: str(v))
def test_state_saved_without_the_dtype_loads_as_float32_input(name, qspec):
    """A state saved before the record (no ``_extra_state``) loads strictly, as then: the
    statistics of a float32 input (those of the input's float32 values)."""
    cls = getattr(quark, name)
    x = _data(torch.bfloat16)
    seen = cls(qspec)
    seen(x)
    old = {k: v for k, v in seen.state_dict().items() if k != "_extra_state"}
    back = cls(qspec)
    back.load_state_dict(old)
    as_float = cls(qspec)
    as_float(x.float())
    for a, b in zip(as_float.calculate_qparams(), back.calculate_qparams(), strict=True):
        _same(a, b)


def test_a_record_with_no_float_dtype_is_a_value_error():
    qspec = {"dtype": "int8"}
    seen = quark.PerTensorMinMaxObserver(qspec)
    seen(_data(torch.float16))
    state = seen.state_dict()
    state["_extra_state"] = torch.frombuffer(bytearray(b'{"input_dtype": "int8", '
                                                       b'"layout": "tensor"}'), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"PerTensorMinMaxObserver.*input_dtype must be a "
                                         r"torch floating-point dtype, got 'int8'"):
        quark.PerTensorMinMaxObserver(qspec).load_state_dict(state)
