"""The percentile's bin where ``p`` percent of the total is a whole count, against an exact
reference: ``p`` is the decimal the user wrote (``Fraction(repr(p))``), not the float just
above or below it (99.9 is above the decimal 99.9: ``99.9 * 41000`` rounds up past 40959)."""

import math
from fractions import Fraction

import pytest
import torch

from quantscope.estimators.percentile import percentile_range, percentile_value
from quantscope.stats.histogram import Hist

BINS = 64


def _exact_bin(counts, share: Fraction) -> int:
    """The first bin whose cumulative count reaches ``share`` percent of the total, exactly."""
    total, cum = int(counts.sum()), 0
    for i, c in enumerate(counts.tolist()):
        cum += c
        if cum * 100 >= share * total:
            return i
    return len(counts) - 1


def _whole_count_rows(p: float, seed: int, n: int = 500):
    """``[n, BINS]`` counts whose cumulative count reaches exactly ``p`` percent of the total
    at some bin: the totals ``m * den`` for ``m = 1 .. n`` (every total where it is a whole
    count; 99.9 * 41000 is one the float test misses), the count split over a few bins."""
    g = torch.Generator().manual_seed(seed)
    frac = Fraction(repr(p)) / 100
    rows = []
    for m in range(1, n + 1):
        total = frac.denominator * m
        k = int(frac * total)  # whole
        below = torch.randint(0, 20, (1,), generator=g).item()
        row = torch.zeros(BINS, dtype=torch.int64)
        head = torch.multinomial(torch.ones(below + 1), min(3, below + 1), generator=g)
        row[head] += k // len(head)
        row[head[0]] += k - k // len(head) * len(head)
        row[BINS - 1 - torch.randint(0, 20, (1,), generator=g).item()] += total - k
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("p", [99.9, 99.99, 99.999, 50.0, 12.5, 0.1])
def test_percentile_value_reaches_the_whole_count_bin(p):
    counts = _whole_count_rows(p, seed=int(p * 1000))
    U = counts.shape[0]
    got = percentile_value(counts, torch.zeros(U), torch.ones(U), p, "lower")
    want = [_exact_bin(row, Fraction(repr(p))) for row in counts]
    assert got.long().tolist() == want


@pytest.mark.parametrize("p", [99.9, 99.99, 50.0])
def test_percentile_range_symmetric_and_both_tails_are_exact(p):
    counts = _whole_count_rows(p, seed=7 + int(p))
    U = counts.shape[0]
    dec = Fraction(repr(p))
    # symmetric: the |x| histogram [0, BINS) (width 1)
    h = Hist(counts, torch.zeros(U), torch.full((U,), float(BINS)), absolute=True)
    _, amax = percentile_range(h, p, symmetric=True, convention="lower")
    assert amax.long().tolist() == [_exact_bin(row, dec) for row in counts]
    # both tails at (100 + p) / 2 percent from their own ends: whole counts for that share
    tail = (100 + dec) / 2
    assert Fraction(repr(float(tail))) == tail
    counts = _whole_count_rows(float(tail), seed=8 + int(p))
    h = Hist(counts, torch.zeros(U), torch.full((U,), float(BINS)))
    lo, hi = percentile_range(h, [p], symmetric=False, convention="lower")
    assert hi[:, 0].long().tolist() == [_exact_bin(row, tail) for row in counts]
    # the lower tail runs on the reversed counts from -hi: the right edge of its bin
    assert lo[:, 0].long().tolist() == [BINS - _exact_bin(row.flip(0), tail) for row in counts]


def test_the_probe_case_and_a_list_of_percents():
    counts = torch.zeros(1, 128, dtype=torch.int64)
    counts[0, 10], counts[0, 120] = 40959, 41  # 99.9 % of 41000 is 40959
    h = Hist(counts, torch.zeros(1), torch.full((1,), 128.0), absolute=True)
    assert percentile_value(counts, torch.zeros(1), torch.ones(1), 99.9, "lower").item() == 10
    _, amax = percentile_range(h, [99.9, 99.99, 50.0], symmetric=True, convention="lower")
    assert amax[0].tolist() == [10.0, 120.0, 10.0]


@pytest.mark.parametrize("p", [99.9999, 99.99, 50.0, 99.9999999])
def test_totals_past_2_to_53_over_the_denominator_stay_exact(p):
    """Totals up to 2 ** 60 (billions of batches of activations): the count just below
    ``p`` percent of the total, the one at it and the one above, in bin 0, the rest in bin 1.
    A float64 test of ``count * 100 den >= num * total`` rounds both products past 2 ** 53
    (about 9e9 counts for 99.9999) and took bin 0 for a count below the share."""
    g = torch.Generator().manual_seed(int(p * 1e7) % 2**31)
    share, rows = Fraction(repr(p)), []
    for e in range(33, 61, 3):
        total = 2**e + int(torch.randint(0, 2**30, (1,), generator=g))
        at = share * total / 100
        for k in (math.floor(at) - 1, math.floor(at), math.ceil(at), math.ceil(at) + 1):
            rows.append([k, total - k, 0, 0])
    counts = torch.tensor(rows, dtype=torch.int64)
    want = [_exact_bin(row, share) for row in counts]
    assert 0 in want and 1 in want
    U = counts.shape[0]
    got = percentile_value(counts, torch.zeros(U), torch.ones(U), p, "lower")
    assert got.long().tolist() == want
    h = Hist(counts, torch.zeros(U), torch.full((U,), 4.0), absolute=True)
    assert percentile_range(h, p, symmetric=True, convention="lower")[1].long().tolist() == want


def test_each_percent_of_a_list_keeps_its_own_exact_test():
    # a list shared one denominator: one eight-place decimal (past the exact test's reach)
    # sent 99.9 to the float test too, which misses the whole count 40959 of 41000
    counts = torch.zeros(1, 128, dtype=torch.int64)
    counts[0, 10], counts[0, 120] = 40959, 41
    h = Hist(counts, torch.zeros(1), torch.full((1,), 128.0), absolute=True)
    _, amax = percentile_range(h, [99.9, 99.99999999], symmetric=True, convention="lower")
    assert amax[0].tolist() == [10.0, 120.0]


def test_counts_in_a_float_dtype_take_the_float_test():
    # fractional counts (a weighted histogram): no whole counts to reach exactly; they were
    # truncated to int64 (half of 10 x 0.3 reached at bin 3, where 1.2 < 1.5)
    counts = torch.full((1, 10), 0.3, dtype=torch.float64)
    for p in (50.0, 99.9, 12.5):
        got = percentile_value(counts, torch.zeros(1), torch.ones(1), p, "lower")
        cum = counts.cumsum(-1)
        want = int((cum * 100 >= p * cum[:, -1:]).long().argmax())  # the float test
        assert got.item() == want
    assert percentile_value(counts, torch.zeros(1), torch.ones(1), 50.0, "lower").item() == 4
