"""``pow2_search`` tells "no candidate chosen" by the search's index (-1), not by its error
(review s49): the error is the float32 rounding of a float64 best, and a chosen error within
half an ulp below float32's max rounds to it, which the old test (``error < FLT_MAX``) read
as "unpriced", putting min-max in place of the chosen range."""

from __future__ import annotations

import torch

from quantscope.estimators import mse as mse_mod
from quantscope.estimators import pow2_search
from quantscope.spec import QuantSpec

F32_MAX = torch.finfo(torch.float32).max


def _search_answering(monkeypatch, index):
    def answer(units, lo, hi, spec, *, factors, **kw):
        j = torch.tensor(index).clamp(min=0)
        f = torch.tensor(factors, dtype=torch.float32)[j]
        err = torch.full_like(lo, F32_MAX)  # a chosen float64 error that rounded up to it
        return mse_mod.SearchResult(lo * f, hi * f, err, None, torch.tensor(index))
    monkeypatch.setattr(mse_mod, "mse_search", answer)


def test_a_chosen_candidate_whose_error_rounds_to_float32s_max_stands(monkeypatch):
    units = torch.tensor([[-1.0, 2.0], [-3.0, 4.0]])
    lo, hi = units.amin(1), units.amax(1)
    _search_answering(monkeypatch, [0, -1])  # unit 0: factor 4 chosen; unit 1: none
    res = pow2_search(units, lo, hi, QuantSpec("int8", "channel:0"), span=2)
    assert res.lo.tolist() == [-4.0, -3.0] and res.hi.tolist() == [8.0, 4.0]
    assert res.index.tolist() == [0, 2]  # none chosen: min-max, the middle candidate
