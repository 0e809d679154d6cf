"""compat.quark's forward adds no tensor op to the native observer's on a small CPU batch (the
token count is read by the C kernel, ``qs_nonzero_rows``, or without it by numpy, Quark's
``(x != 0).any(-1)`` row for row; the min / max by the native's cached C call, no op either)
and takes no state key on a repeated shape. No Quark needed (dict qspecs)."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames
from test_quark_overhead import _rows  # the edge rows: zeros, -0.0, NaN, inf, a subnormal

from quantscope import kernels
from quantscope.compat import quark
from quantscope.compat.quark_scales import _HOST_COUNT_BELOW, quark_token_count
from quantscope.observers.minmax import MemorylessMinMaxObserver, StaticMinMaxObserver


def _quarks(x: torch.Tensor) -> int:
    return int(x.ne(0).any(-1).sum())  # Quark's record_observed_tokens expression


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 64), (6, 3, 40), (64, 256), (300, 512)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no-kernel"])
def test_token_count_is_quarks(shape, dtype, threads, kernel, monkeypatch):
    """Quark's count by each path: the C kernel where it loads, numpy or torch without it
    (``no-kernel``: the library hidden, so the numpy / torch split is tested here too)."""
    if not kernel:
        lib = kernels.lib
        monkeypatch.setattr(kernels, "lib", lambda name: None if name == "unit_minmax"
                            else lib(name))
    x, before = _rows(shape, dtype), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = quark_token_count(x)
    finally:
        torch.set_num_threads(before)
    assert int(got) == _quarks(x)
    # the C kernel reads every contiguous one; without it numpy the smaller ones
    host = (kernel and kernels.available("unit_minmax")) or x.numel() < _HOST_COUNT_BELOW.get(
        dtype, 0) or (threads == 1 and dtype in (torch.float32, torch.float64))
    assert isinstance(got, int) == host  # else a 0-dim int64 tensor (no host sync off the CPU)


@pytest.mark.parametrize("make", [
    lambda x: x.t(),  # strided
    lambda x: x[:1].expand(5, -1),  # zero strides
    lambda x: torch.nn.Parameter(x),  # requires grad
    lambda x: torch._neg_view(x),  # lazy negation: numpy cannot read it (torch counts)
])
def test_token_count_of_views(make):
    x = make(_rows((8, 64), torch.float32))
    assert int(quark_token_count(x)) == _quarks(x.detach())


def test_token_count_of_inference_tensor():
    with torch.inference_mode():
        x = _rows((8, 64), torch.float32)
    assert quark_token_count(x) == _quarks(x)


@pytest.mark.parametrize("shape", [(5, 0), (0, 5), (2, 0, 4), (3, 4, 0), (5,), ()], ids=str)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no-kernel"])
def test_token_count_outside_forwards_shapes(shape, kernel, monkeypatch):
    """Shapes forward does not count (it counts 2-D+ batches, not empty) get Quark's
    expression all the same: an empty last axis 0 rows (the kernel's division by it raised
    ZeroDivisionError), a 0-dim tensor one row (IndexError on its last axis), as numpy's
    count gives them without the kernel."""
    if not kernel:
        monkeypatch.setattr(kernels, "lib", lambda name: None)
    for x in (torch.ones(shape), torch.zeros(shape)):
        assert int(quark_token_count(x)) == _quarks(x)


def test_token_count_with_denormals_flushed():
    x = _rows((8, 64), torch.float32)
    torch.set_flush_denormal(True)
    try:
        got, want = quark_token_count(x), _quarks(x)
    finally:
        torch.set_flush_denormal(False)
    assert got == want


def _ops_of(obs, x) -> list:
    with OpNames() as mode:
        obs(x)
    # (numpy's count, where the kernel does not load: x.numpy() detaches its view first, no
    # kernel, no memory read)
    return [op for op in mode.order if op != "aten.detach.default"]


CASES = [("PerTensorMinMaxObserver", {"dtype": "int8"}),
         ("PerChannelMinMaxObserver", {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}),
         ("PerGroupMinMaxObserver", {"dtype": "int4", "qscheme": "per_group", "ch_axis": -1,
                                     "group_size": 32}),
         ("PerBlockMXObserver", {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1,
                                 "group_size": 32, "scale_format": "e8m0", "is_dynamic": True})]


@pytest.mark.parametrize(("name", "qspec"), CASES)
def test_forward_adds_no_op_to_the_natives(name, qspec):
    """Quark's accumulating and dynamic / per-group / MX observers take the native's cached
    CPU call (observers/minmax_step.py): one C pass, no tensor op, as the native class of the
    same spec; the token count is the C kernel's (no op either)."""
    obs = getattr(quark, name)(qspec)
    native = (StaticMinMaxObserver if obs.accumulates else MemorylessMinMaxObserver)(obs.spec)
    x = _rows((8, 64), torch.float32).nan_to_num()
    for o in (obs, native):
        o(x)  # the first call sizes the state (the general path), the second one plans
        o(x)
    assert _ops_of(obs, x) == _ops_of(native, x) == []
    assert obs._num_observed_tokens == 3 * _quarks(x)  # three calls


def test_repeated_shape_takes_no_state_key(monkeypatch):
    obs = quark.PerChannelMinMaxObserver({"dtype": "int8", "qscheme": "per_channel",
                                          "ch_axis": 1})
    obs(torch.randn(4, 6))
    keys = []
    key = type(obs)._quark_state_key
    monkeypatch.setattr(type(obs), "_quark_state_key", lambda s, shape: keys.append(shape)
                        or key(s, shape))
    obs(torch.randn(4, 6))
    assert keys == []
    obs(torch.ones(2, 3))  # another channel count: Quark's starts over
    assert keys and obs.min_val.shape == (3,) and bool((obs.min_val == 1).all())
