"""Mutation round s47 on ``mse_tiles.candidate_qparams``: a candidate whose *lower* end alone
leaves float32 (a unit holding -3.4e38, its largest value small) is priced NaN as well; the
s46 tests' units overflow on both sides at once (a column of float32's max in every row)."""

import pytest
import torch

import quantscope
from quantscope import QuantSpec
from quantscope.estimators.mse import mse_search

F = torch.finfo(torch.float32).max


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int8", "channel:0")], ids=str)
@pytest.mark.parametrize("backend", ["torch", "kernel", "ops"])
def test_lower_end_alone_past_float32_is_never_chosen(spec, backend):
    w = torch.tensor([[-F, 1.0, 2.0, 0.5] * 8, [-1.0, 3.0, F / 1.2, 0.25] * 8])
    if str(spec.layout) == "Tensor()":
        w = w[:1]
    units = spec.layout.to_units(w)
    lo, hi = units.amin(1), units.amax(1)
    r = mse_search(units, None, None, spec, expand=1.5, backend=backend)
    assert bool(torch.isfinite(r.lo).all() and torch.isfinite(r.hi).all())
    # unit 0: every candidate (lo * 1.5) * p is -inf below the min-max one: min-max stands
    assert int(r.index[0]) == -1
    assert torch.equal(r.lo[0], lo[0]) and torch.equal(r.hi[0], hi[0])


def test_memoryless_mse_lower_end_at_float32_max_gives_min_max_qparams():
    w = torch.tensor([[-F, 1.0, 2.0, 0.5] * 8])
    mm = quantscope.get_observer("memoryless_minmax", QuantSpec("int8"))
    o = quantscope.get_observer("memoryless_mse", QuantSpec("int8"), expand=1.5)
    mm(w), o(w)
    assert torch.equal(o.calculate_qparams().scale, mm.calculate_qparams().scale)
