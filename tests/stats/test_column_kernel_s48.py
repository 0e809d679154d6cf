"""The C column kernel (``qs_col_minmax``): cases a mutation round on it found untested (s48),
against the reference of tests/stats/test_column_kernel_s47.py (the rule its results keep:
each slab's rows cut into ``shares``, a share's last tying value in the vector columns and
its first in the others, the shares merged in order, the first winning a tie)."""

from __future__ import annotations

import pytest
import torch
from march_builds import cpu_has
from test_column_kernel_s47 import _call, bits, reference, values

from quantscope.stats import minmax as stats

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")

QS_MAXT = 64  # csrc/qs_threads.h: the most threads a kernel runs


@pytest.mark.parametrize("shares", [100, 130])
@pytest.mark.parametrize("kind", ["zero min", "zero max"])
def test_more_shares_than_threads_ever_run_are_cut_as_the_capped_threads(shares, kind):
    """``shares`` past the kernels' thread cap (a caller on a machine of more cores than
    that): the rows are cut as the capped threads cut them, so the sign of a zero min / max
    is the one of ``QS_MAXT`` shares, whatever the count asked."""
    lib, vector = stats._kernel(), cpu_has("avx2", "f16c")
    x = values((1, 130, 40), torch.float32, kind, seed=shares)
    want = reference(x, QS_MAXT, vector)
    for threads in (1, 2):
        got = _call(lib, x, threads, shares, 1)
        for a, b in zip(got, want):
            assert torch.equal(bits(a), bits(b))
    end = 0 if kind == "zero min" else 1  # (the cut shows: the uncapped one differs)
    assert not torch.equal(bits(reference(x, shares, vector)[end]), bits(want[end]))


@pytest.mark.parametrize("fill", [0.0, float("nan"), -1e30])
@pytest.mark.parametrize("kind", ["plain", "zero min", "nan"])
def test_threads_whose_shares_hold_no_rows_add_nothing(kind, fill):
    """One slab of fewer rows than shares, on several threads: a thread whose shares hold
    no rows writes no results, and the merge must skip its scratch (whatever it held)."""
    lib, vector = stats._kernel(), cpu_has("avx2", "f16c")
    for R, shares, threads in ((1, 4, 2), (1, 4, 4), (2, 4, 4), (3, 4, 3), (2, 3, 3)):
        for C in (1, 9, 40):
            x = values((1, R, C), torch.float32, kind, seed=R * 100 + C)
            lo, hi = torch.full((C,), 7.0), torch.full((C,), 7.0)
            work = torch.full((threads * 5 * C,), fill)  # (csrc: 5C floats a thread)
            assert lib.qs_col_minmax(x.data_ptr(), 1, R, C, lo.data_ptr(), hi.data_ptr(),
                                     work.data_ptr(), threads, shares, 1, 0) == 0
            want = reference(x, shares, vector)
            assert torch.equal(bits(lo), bits(want[0][0]))
            assert torch.equal(bits(hi), bits(want[1][0]))
            # (and torch's column min / max, a zero's sign aside: NaN propagates in both)
            assert torch.equal(lo.nan_to_num(7.0), x[0].amin(0).nan_to_num(7.0))
            assert torch.equal(hi.nan_to_num(7.0), x[0].amax(0).nan_to_num(7.0))
