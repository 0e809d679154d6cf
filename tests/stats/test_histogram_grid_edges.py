"""Edges of the native histogram grid (stats.histogram): an all-zero range and an empty one.

The grid exponent depends only on the range seen, so zeros seen before small data must give
the same state (counts, exponent, first bin) as zeros seen after it or with it, in every
backend (torch, C kernel, Triton), in the observers, in ``merge``; and a merge of states
that saw nothing is a state that saw nothing.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import fresh_interpreter_test

import quantscope as qs
from quantscope import kernels
from quantscope.kernels import triton as qs_triton
from quantscope.stats import hist_kernel as HK
from quantscope.stats import histogram as H

test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

SMALL = 1e-6  # |x| ~ 1e-6: its grid is far finer than 2 ** -23


def _small(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * SMALL


def _state(x, absolute, bins=256):
    return H.update(H.empty_state(x.shape[0], bins), x, x.amin(1), x.amax(1), absolute)


def _assert_same(a, b):
    for name, x, y in zip(("counts", "exp", "first"), a, b):
        assert torch.equal(x, y), (name, x, y)


def test_grid_exponent_of_an_all_zero_range_is_e_min():
    # every aligned grid holds [0, 0] in one bin: the smallest is E_MIN's
    zero = torch.zeros(3)
    assert H.grid_exponent(zero, zero, 2048).tolist() == [H.E_MIN] * 3
    # the magnitude floor still applies where there is a magnitude: 2 ** 10 in bins < 2 ** 23
    x = torch.tensor([2.0 ** 10])
    assert int(H.grid_exponent(torch.zeros(1), x, 2 ** 30)) == 10 - H._MAG_BITS


@pytest.mark.parametrize("absolute", [False, True])
def test_zeros_then_small_data_is_small_data_then_zeros(absolute):
    zeros, x = torch.zeros(3, 50), _small((3, 50))
    want = _state(torch.cat([zeros, x], 1), absolute)
    for first, then in ((zeros, x), (x, zeros)):
        s = _state(first, absolute)
        _assert_same(H.update(s, then, then.amin(1), then.amax(1), absolute), want)
    assert int(want.exp.max()) < -23  # the case: a grid finer than the old floor


@pytest.mark.parametrize("absolute", [False, True])
def test_merge_with_a_state_of_zeros_is_the_union(absolute):
    zeros, x = torch.zeros(3, 50), _small((3, 50))
    want = _state(torch.cat([zeros, x], 1), absolute)
    _assert_same(H.merge(_state(zeros, absolute), _state(x, absolute), absolute), want)
    _assert_same(H.merge(_state(x, absolute), _state(zeros, absolute), absolute), want)


@pytest.mark.parametrize("absolute", [False, True])
def test_merge_of_empty_states_is_empty(absolute):
    empty = H.empty_state(2, 256)
    e = H.merge(empty, H.empty_state(2, 256), absolute)
    for name, a, b in zip(H.HistState._fields, e, empty):
        assert torch.equal(a, b), name
    s = _state(_small((2, 100)) * 1e-3, absolute)
    _assert_same(H.merge(e, s, absolute), s)
    _assert_same(H.merge(s, e, absolute), s)


OBSERVERS = ["percentile", "histogram", "histogram_mse", "entropy", "mix"]


def _observe(name, spec, batches, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(HK, "_kernel", lambda: None)
    o = qs.get_observer(name, spec)
    for b in batches:
        o(b)
    monkeypatch.undo()
    return o


def _assert_same_observer(a, b):
    for n in ("hist_counts", "hist_exp", "hist_first"):
        assert torch.equal(getattr(a, n), getattr(b, n)), n


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("spec", [qs.QuantSpec("int8"), qs.QuantSpec("uint8", symmetric=False)],
                         ids=["abs", "signed"])
@pytest.mark.parametrize("name", OBSERVERS)
def test_observers_count_zeros_first_as_zeros_last(name, spec, kernel, monkeypatch):
    if kernel and not kernels.available("hist_kernel"):
        pytest.skip("no C compiler: torch path only")
    zeros, x = torch.zeros(64, 256), _small((64, 256))  # 16K values: the fused C pass too
    a = _observe(name, spec, [zeros, x], kernel, monkeypatch)
    b = _observe(name, spec, [x, zeros], kernel, monkeypatch)
    _assert_same_observer(a, b)
    assert int(a.hist_exp) < -23


@pytest.mark.parametrize("kernel", [False, True])
def test_channel_all_zero_in_the_first_batch_only(kernel, monkeypatch):
    if kernel and not kernels.available("hist_kernel"):
        pytest.skip("no C compiler: torch path only")
    spec = qs.QuantSpec("int8", "channel:1")
    x1, x2 = _small((8, 4), 1), _small((8, 4), 2)
    x1[:, 2] = 0
    a = _observe("percentile", spec, [x1, x2], kernel, monkeypatch)
    b = _observe("percentile", spec, [x2, x1], kernel, monkeypatch)
    _assert_same_observer(a, b)


def _grid_run(regrid, ranges, absolute, U=3, B=256):
    """The grid changes of ``ranges`` (batch min / max) from an empty state, counts added
    between them: ``regrid(state, lo, hi)`` is one backend's ``_update_grid``."""
    state = H.empty_state(U, B)
    g = torch.Generator().manual_seed(0)
    for lo, hi in ranges:
        state = regrid(state, lo, hi, absolute)
        state = state._replace(counts=state.counts + torch.randint(0, 9, (U, B), generator=g))
    return state


def _zeros_and_small(U=3):
    x = _small((U, 50))
    return (torch.zeros(U), torch.zeros(U)), (x.amin(1), x.amax(1))


def _c_regrid(state, lo, hi, absolute):
    new = HK.regrid(state, lo, hi, absolute)
    assert new is not None
    return H.HistState(*new)


def _triton_regrid(state, lo, hi, absolute):
    from quantscope.kernels.triton import histogram as tri

    new = H.HistState(*(t.clone() for t in state))
    tri.regrid_(*new, lo.float(), hi.float(), absolute, block=64)
    return new


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("backend", ["torch", "c", "triton"])
def test_grid_change_of_zeros_then_small_in_every_backend(backend, absolute):
    if backend == "c" and not kernels.available("hist_kernel"):
        pytest.skip("no C compiler: torch path only")
    if backend == "triton":
        pytest.importorskip("triton")
        if not qs_triton.runs_on("cpu"):
            pytest.skip("triton was imported before TRITON_INTERPRET was set: "
                        "test_in_a_fresh_interpreter runs this file in a child process")
    regrid = {"torch": H._update_grid, "c": _c_regrid, "triton": _triton_regrid}[backend]
    zeros, small = _zeros_and_small()
    got = _grid_run(regrid, [zeros], absolute)
    assert got.exp.tolist() == [H.E_MIN] * 3
    want = _grid_run(H._update_grid, [small], absolute)
    for ranges in ([zeros, small], [small, zeros]):
        got = _grid_run(regrid, ranges, absolute)
        assert torch.equal(got.exp, want.exp) and torch.equal(got.first, want.first)
        _assert_same(got, _grid_run(H._update_grid, ranges, absolute))
