"""The launchers' host side (issue 35's wall time on a GPU is mostly the host's): the grid
arithmetic in plain Python, not Triton's constexpr functions (~5 us a host call since Triton
3.5: the nine of one min / max launch were most of its Python), no tensor made for a Python
constant, with the values as before."""

from __future__ import annotations

import pytest
import torch
import triton
from op_names import OpNames
from tiers import each_value
from triton_interpreter import fresh_interpreter_test

from quantscope import QuantSpec, presets
from quantscope.kernels import ops
from quantscope.kernels.triton import _jit, minmax
from quantscope.qparams import qparams_from_range
from quantscope.stats import minmax as stats_minmax

test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)


def _fn(f):
    return getattr(f, "fn", f)  # a constexpr function's Python function


@pytest.mark.parametrize("a", [*range(70), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3])
def test_grid_arithmetic_is_tritons(a):
    assert _jit.next_power_of_2(a) == _fn(triton.next_power_of_2)(a)
    for b in (1, 2, 3, 16, 512, 1024, 4096):
        assert _jit.cdiv(a, b) == _fn(triton.cdiv)(a, b)


@pytest.fixture
def no_triton_grid_helpers(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a launcher called triton.cdiv / next_power_of_2 on the host")

    monkeypatch.setattr(triton, "cdiv", refused)
    monkeypatch.setattr(triton, "next_power_of_2", refused)


def _units(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 3


@pytest.mark.parametrize("shape", [(1, 3000), (5, 33), (40, 16)])  # split, rows, blocks
def test_minmax_path_launchers_use_no_triton_host_helpers(device, no_triton_grid_helpers,
                                                          shape):
    """The min-max path's launches (per-unit min / max, the non-finite record, the qparams
    ops) size their grids without Triton's host helpers, with the torch path's values."""
    units = _units(shape)
    lo, hi = ops.unit_minmax(units.to(device))
    ref_lo, ref_hi = torch.aminmax(units, dim=1)
    assert torch.equal(lo.cpu(), ref_lo) and torch.equal(hi.cpu(), ref_hi)
    seen = torch.zeros((), dtype=torch.bool, device=device)
    stats_minmax.record_non_finite(lo, hi, seen)
    assert not bool(seen)
    los, his = ops.grouped_unit_minmax([units.to(device), units[:, :7].contiguous().to(device)])
    assert torch.equal(los[0].cpu(), ref_lo)
    assert torch.equal(his[1].cpu(), units[:, :7].amax(1))
    for spec in (QuantSpec("int8"), presets.MXFP4, presets.NVFP4):  # the qparams ops
        got = qparams_from_range(lo, hi, spec, check_finite=False)
        want = qparams_from_range(ref_lo, ref_hi, spec, check_finite=False)
        assert torch.equal(got.scale.cpu(), want.scale)


@pytest.mark.parametrize("kind", ["ema", "ema_lerp"])
@pytest.mark.parametrize("c", [0.01, 1 / 3, 0.7, 1e-8, 1.0])
def test_update_state_rounds_its_constants_without_tensors(device, no_triton_grid_helpers,
                                                           kind, c):
    """The fused state update takes ``c`` and ``1 - c`` rounded to float32 in Python (a
    tensor each took six ops per observer call): each step rounded as the torch ops round
    it, bit for bit."""
    lo, hi = torch.aminmax(_units((9, 20)), dim=1)
    state = [t.clone() - 1 for t in (lo, hi)]
    want = [t.clone() for t in state]
    stats_minmax._update_state(kind, c, *want, lo.clone(), hi.clone())
    got = [t.to(device) for t in state]
    seen = torch.zeros((), dtype=torch.bool, device=device)
    with OpNames() as ops_seen:
        minmax.update_state(lo.to(device), hi.to(device), *got, seen,
                            stats_minmax.UPDATES[kind], c)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    assert not ops_seen.names & {"aten.lift_fresh", "aten._local_scalar_dense", "aten.item"}


@pytest.mark.parametrize(("shape", "bad", "kind"), each_value(
    [((1, 60000),), ((3, 9000),), ((1, 3000),)],  # 30, 5 and 2 chunks (a shape each)
    [None, float("nan"), float("inf"), float("-inf")], sorted(stats_minmax.UPDATES.values()),
    ids=str))
def test_accumulating_step_joins_its_chunks_in_the_state_launch(device, kind, bad, shape):
    """An accumulating observer's step (``minmax_observe``) on few units, whose elements
    the min / max launch splits into chunks: the state launch joins the chunks' extremes (no
    amin / amax ops between the two launches, four dispatches each call), with the CPU op's
    state and non-finite flag (a NaN / inf in a late chunk included)."""
    x = _units(shape, seed=kind)
    if bad is not None:
        x[-1, -7] = bad
    _, _, splits = minmax.partial_minmax(x.to(device))
    assert splits > 1
    g = torch.Generator().manual_seed(kind)
    lo = torch.randn(shape[0], generator=g) - 1

    def state(dev):
        return (lo.clone().to(dev), (lo + 3).to(dev), torch.zeros((), dtype=torch.bool, device=dev),
                torch.zeros((), dtype=torch.int64, device=dev))

    want = state("cpu")
    stats_minmax.minmax_observe(x, *want, kind, 0.25, 5)
    got = state(device)
    with OpNames() as ops_seen:
        stats_minmax.triton_minmax_observe(minmax, x.to(device), *got, kind, 0.25, 5)
    assert not ops_seen.names & {"aten.amin", "aten.amax", "aten.aminmax"}
    for a, b in zip(got, want):
        a = a.cpu()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
