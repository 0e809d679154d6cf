"""mse_tiles.finite_candidates: the one host read that lets the C kernel's search skip the
per-block mask of candidates past float32 (candidate_qparams' NaN scale)."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope.estimators.mse_tiles import candidate_qparams, finite_candidates
from quantscope.presets import INT8_PER_TENSOR as INT8

BIG = torch.finfo(torch.float32).max
ends = st.lists(st.one_of(st.floats(-4.0, 4.0, width=32),
                          st.floats(-BIG, BIG, width=32),
                          st.sampled_from([BIG, -BIG, 0.0, math.nan])), min_size=0, max_size=6)
factors = st.lists(st.floats(0.0, 2.0, width=32), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(ends, ends, factors)
def test_finite_candidates_is_every_product_finite(lo, hi, f):
    """The bound max|end| * max|factor| is itself a candidate, so the answer is exact."""
    lo_t, hi_t = torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32)
    f_t = torch.tensor(f, dtype=torch.float32)
    every = all(bool(torch.isfinite(e[None] * f_t[:, None]).all()) for e in (lo_t, hi_t))
    assert finite_candidates((lo_t, hi_t), (f_t,)) == every


def test_unmasked_qparams_equal_masked_ones_where_every_candidate_is_finite():
    lo = torch.tensor([[-3.0, -1e30, 0.0]])
    hi = torch.tensor([[2.0, 1e30, 1e-30]])
    assert finite_candidates((lo, hi), (torch.tensor([1.0, 1.5]),))
    a = candidate_qparams(lo, hi, INT8, None)
    b = candidate_qparams(lo, hi, INT8, None, finite=True)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
    past = candidate_qparams(lo * 1e9, hi * 1e9, INT8, None)
    assert torch.isnan(past.scale[0, 1]) and not torch.isnan(past.scale[0, 0])


def test_an_end_given_twice_is_read_once(monkeypatch):
    """The kernel search passes ``(lo, hi, *incumbent)``, the incumbent mostly ``(lo, hi)``
    itself: each tensor's ``|end|`` max is taken once (two passes, not four)."""
    lo, hi, f = torch.tensor([-1.0, -2.0]), torch.tensor([3.0, BIG]), torch.tensor([1.0, 1.5])
    read = []
    abs_ = torch.Tensor.abs
    monkeypatch.setattr(torch.Tensor, "abs", lambda t: read.append(t) or abs_(t))
    assert not finite_candidates((lo, hi, lo, hi), (f,))
    assert [id(t) for t in read if t is not f] == [id(lo), id(hi)]
    read.clear()
    other = hi.clone()  # an incumbent of its own: read too
    assert finite_candidates((lo, hi.clamp(max=1.0), lo, other.clamp(max=1.0)), (f,))
    assert len([t for t in read if t is not f]) == 3

