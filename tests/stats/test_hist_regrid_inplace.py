"""The C grid change (stats.hist_kernel.regrid) moves only the units whose grid changes: in
place (``inplace=True``: the state's own tensors) a unit whose grid stays is not touched,
and fresh counts are not zero-filled first. Both equal the torch reference
``_update_grid`` bit for bit, on grids that change for some units and not others."""

import pytest
import torch

from quantscope import kernels
from quantscope.stats import hist_kernel as HK
from quantscope.stats import histogram as H

pytestmark = pytest.mark.skipif(not kernels.available("hist_kernel"),
                                reason="no C compiler: torch path only")


def _same(a, b):
    for name, x, y in zip(H.HistState._fields, a, b):
        assert torch.equal(x, y), name


def _batch(g, U, E, lo, hi, step):
    """Per unit, a batch inside the current range (the grid stays), or one that grows it,
    shrinks inside it, shifts it left or right, or is tiny (some grids change, some not)."""
    x = torch.rand(U, E, generator=g)
    kind = torch.randint(0, 5, (U, 1), generator=g)
    span = (hi - lo).clamp(min=1e-3)[:, None]
    inside = lo[:, None] + x * span
    grow = (x * 2 - 1) * span * (2.0 + step)
    shift = inside + span * torch.where(torch.rand(U, 1, generator=g) < 0.5, -1.5, 1.5)
    tiny = (x - 0.5) * 1e-6
    out = torch.where(kind == 0, inside, torch.where(kind == 1, grow, torch.where(
        kind == 2, inside * 0.25, torch.where(kind == 3, shift, tiny))))
    return out


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("U,B", [(1, 16), (1, 17), (7, 255), (64, 256), (300, 2048), (33, 1)])
def test_regrid_moves_only_changed_units_bitwise(U, B, absolute):
    g = torch.Generator().manual_seed(U * 1000 + B + absolute)
    ref = H.empty_state(U, B)
    pure = inp = H.HistState(*(t.clone() for t in ref))
    lo, hi = torch.full((U,), -1.0), torch.ones(U)
    stayed = changed = 0
    for step in range(8):
        x = _batch(g, U, 9, lo, hi, step)
        lo, hi = x.amin(1), x.amax(1)
        want = H._update_grid(ref, lo, hi, absolute)
        before = [t.clone() for t in pure]
        fresh = HK.regrid(pure, lo, hi, absolute)
        _same(pure, before)  # not modified
        _same(fresh, want)
        moved = HK.regrid(inp, lo, hi, absolute, inplace=True)
        assert all(a is b for a, b in zip(moved, inp))  # the state itself, in place
        _same(moved, want)
        same = int(((want.exp == ref.exp) & (want.first == ref.first)).sum())
        stayed, changed = stayed + same, changed + U - same
        ref, pure, inp = (H.HistState(*s) for s in (want, fresh, moved))
        for s in (ref, pure, inp):  # nonzero counts, for the next grid change to move
            H.add_values(s.counts, x, s.exp, s.first, absolute)
    # the case: units whose grid stays beside ones whose grid changes
    assert changed > 0 and (stayed > 0 or U == 1)


def test_inplace_regrid_on_nan_leaves_the_state_alone():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=g)
    state = H.update(H.empty_state(5, 64), x, x.amin(1), x.amax(1))
    before = [t.clone() for t in state]
    lo, hi = x.amin(1) * 3, x.amax(1) * 3
    hi[3] = float("nan")
    assert HK.regrid(state, lo, hi, False, inplace=True) is None
    _same(state, before)


@pytest.mark.parametrize("absolute", [False, True])
def test_update_inplace_equals_update(absolute):
    g = torch.Generator().manual_seed(1)
    U, B = 200, 513
    a = b = H.empty_state(U, B)
    lo, hi = torch.full((U,), -1.0), torch.ones(U)
    for step in range(6):
        x = _batch(g, U, 33, lo, hi, step)
        lo, hi = x.amin(1), x.amax(1)
        old = b
        a = H.update(a, x, lo, hi, absolute)
        b = H.update(b, x, lo, hi, absolute, inplace=True)
        assert all(s is t for s, t in zip(b, old))  # the state's own tensors
        _same(b, a)
