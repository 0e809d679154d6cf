"""The Triton implementation of ``quantscope::minmax_observe`` (an accumulating min-max
observer's step) bitwise against the op's CPU implementation, under the interpreter on CPU
tensors (compiled on CUDA where a GPU is present)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from op_names import OpNames
from triton_interpreter import fresh_interpreter_test

from quantscope.kernels import triton as qs_triton
from quantscope.stats import minmax

test_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

SHAPES = [(1, 3000), (7, 33), (64, 5), (2, 3, 4, 9)]  # one unit, rows, short rows, 4-D view


def _state(units, seed):
    n = minmax.op_unit_count(units)
    g = torch.Generator().manual_seed(seed)
    lo = torch.randn(n, generator=g) - 1
    return (lo, lo + 2 * torch.rand(n, generator=g), torch.zeros((), dtype=torch.bool),
            torch.full((), 5, dtype=torch.int64))


@settings(max_examples=30, deadline=None)
@given(shape=st.sampled_from(SHAPES), kind=st.sampled_from(sorted(minmax.UPDATES.values())),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       c=st.sampled_from([0.01, 0.3, 1.0]), seed=st.integers(0, 10**6),
       bad=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]))
def test_triton_step_is_the_cpu_op(device, shape, kind, dtype, c, seed, bad):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    if bad is not None:
        x.view(-1)[seed % x.numel()] = bad
    units = x.to(dtype)
    if units.dim() == 4:  # a strided [U1, U2, E1, E2] view, as op_units makes for tiles
        units = units.permute(0, 2, 1, 3)
    ref = _state(units, seed)
    minmax.minmax_observe(units, *ref, kind, c, 11)
    got = [t.to(device) for t in _state(units, seed)]
    minmax.triton_minmax_observe(qs_triton.launchers("minmax", got[0]), units.to(device),
                                 *got, kind, c, 11)
    for a, b in zip(ref, got):
        b = b.cpu()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


INF = float("inf")


@pytest.mark.parametrize("lo,hi,seen", [
    ([INF, 1.0], [2.0, 3.0], True),     # a caller's lo > hi holding +inf in lo
    ([1.0, 0.0], [-INF, 3.0], True),    # ... and -inf in hi
    ([0.0, -1.0], [1.0, 2.0], False),
    ([0.0, float("nan")], [1.0, 2.0], True),
    ([-INF, 0.0], [1.0, 2.0], True),
    ([0.0, 1.0], [2.0, INF], True),
])
def test_record_non_finite_is_the_same_test_on_both_paths(device, lo, hi, seen):
    """``seen`` is set where any ``lo`` / ``hi`` is NaN or infinite, on the CPU as by the
    Triton kernel (the CPU once tested only the smallest min and the largest max, which
    misses a +inf min of a unit whose lo > hi)."""
    lo, hi = torch.tensor(lo), torch.tensor(hi)
    cpu = torch.zeros((), dtype=torch.bool)
    minmax.record_non_finite(lo, hi, cpu)
    got = torch.zeros((), dtype=torch.bool, device=device)
    qs_triton.launchers("minmax", got).update_state(lo.to(device), hi.to(device), None, None,
                                                    got, 0, 0.0)
    assert bool(cpu) == bool(got.cpu()) == seen


@pytest.mark.parametrize("count", [0, 1, 16, 2**33 + 3])
@pytest.mark.parametrize("shape", [(7, 33), (2500, 3), (0, 33)], ids=["units", "3-programs",
                                                                     "none"])
def test_the_state_launch_adds_the_token_count(device, count, shape):
    """The state launch adds the call's tokens itself (no launch of their own), a count
    past int32 included, once however many programs it has (2500 units: three of 1024, the
    count added by program 0 alone); with no unit (no launch) they are added all the
    same."""
    units = torch.randn(shape)
    ref = _state(units, 0)
    minmax.minmax_observe(units, *ref, minmax.UPDATES["min"], 0.0, count)
    got = [t.to(device) for t in _state(units, 0)]
    units, kernel = units.to(device), qs_triton.launchers("minmax", got[0])
    with OpNames() as seen:
        minmax.triton_minmax_observe(kernel, units, *got, minmax.UPDATES["min"], 0.0, count)
    assert ("aten.add_" in seen.names) == (not units.numel())
    assert int(got[3]) == int(ref[3]) == 5 + count
    assert all(torch.equal(a, b.cpu()) for a, b in zip(ref[:3], got[:3]))


def test_a_flag_only_launch_of_three_programs_adds_the_token_count_once(device):
    """No state to update (kind 0: the non-finite flag alone) over 2500 units: one launch of
    three programs, the flag set from the third's units, the count added once."""
    units = torch.randn(2500, 3, generator=torch.Generator().manual_seed(0))
    units[2400, 1] = float("nan")
    lo, hi = units.amin(1).to(device), units.amax(1).to(device)
    seen = torch.zeros((), dtype=torch.bool, device=device)
    tokens = torch.full((), 5, dtype=torch.int64, device=device)
    qs_triton.launchers("minmax", lo).update_state(lo, hi, None, None, seen, 0, 0.0, 1,
                                                   tokens, 7)
    assert int(tokens) == 5 + 7 and bool(seen)
