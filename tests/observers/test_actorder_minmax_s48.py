"""Act-order groups read in place (``stats.minmax_actorder``, the C ``qs_actorder_minmax``):
cases a mutation round on them found untested (s48). Each result is the permuted copy's
(``to_units`` then the row kernel) bit for bit, or torch's min / max of the permuted columns:
a negative view and the ``out_for`` pairs it is handed, fewer rows than threads, half units
of all zeros in the widening pieces, zero-min / zero-max units among units that are not all
zeros (the fast pass's order differs from the row kernel's only in a zero's sign), a
redone chunk that must start where the copy's run starts, NaN in the columns past the last
whole vector, and units of +inf / float32's max values."""

from __future__ import annotations

import pytest
import torch
from test_actorder_minmax import act_order, assert_same, torch_minmax

import quantscope
from quantscope import QuantSpec
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_actorder, minmax_layouts

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def signed_zeros(shape, seed):
    """Zeros of random signs."""
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)


@pytest.fixture
def threads(monkeypatch):
    """``set(n)``: the kernels' thread count, every input split over threads (restored)."""
    monkeypatch.setattr(stats, "THREAD_MIN_NUMEL", 1)
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_negative_view_is_read_by_its_values(dtype):
    """``torch._neg_view``: its memory holds the values negated; the in-place pass must not
    read that memory as the values (torch's min / max of the permuted columns, or the copy
    path). The observer's state is the one of the same values made plain."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(16, 128, generator=g).abs_().add_(1.0).to(dtype)  # all positive
    x = torch._neg_view(y)
    assert x.is_neg()
    layout = act_order(128, 16, seed=1)
    got = minmax_layouts.layout_minmax(x, layout)
    if got is not None:
        lo, hi = torch_minmax(x.resolve_neg(), layout)
        assert torch.equal(got[0], lo) and torch.equal(got[1], hi)
    spec = QuantSpec("int4", layout)
    a, b = (quantscope.get_observer("static_minmax", spec) for _ in range(2))
    a(x)
    b(x.resolve_neg())
    assert bool((a.max_vals < 0).all())  # the values are negative
    assert torch.equal(a.min_vals, b.min_vals) and torch.equal(a.max_vals, b.max_vals)


def test_out_for_is_written_in_place_and_its_version_bumped():
    """``out_for(U)`` is asked for the units' count; a pair that fits is the result, its
    version counters bumped (the C writes it, as an in-place op would); one that does not
    fit is left alone."""
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))
    layout = act_order(256, 32, seed=2)
    U = layout.num_units(x.shape)
    out, asked = (torch.full((U,), 9.0), torch.full((U,), 9.0)), []
    versions = [t._version for t in out]
    lo, hi = minmax_actorder.actorder_minmax(x, layout, lambda n: asked.append(n) or out)
    assert asked == [U]
    assert lo.data_ptr() == out[0].data_ptr() and hi.data_ptr() == out[1].data_ptr()
    assert all(t._version > v for t, v in zip(out, versions))
    want = torch_minmax(x, layout)
    assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])
    wrong = (torch.full((U + 1,), 9.0), torch.full((U + 1,), 9.0))
    again = minmax_actorder.actorder_minmax(x, layout, lambda n: wrong)
    assert again[0].data_ptr() != wrong[0].data_ptr() and torch.equal(again[0], lo)
    assert bool((wrong[0] == 9.0).all()) and bool((wrong[1] == 9.0).all())


def test_out_for_pairs_that_are_negative_views_are_not_written_raw():
    """A pair whose memory is not its values (``torch._neg_view``) takes no raw C write:
    the results read back as torch's min / max."""
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    layout = act_order(128, 16, seed=3)
    U = layout.num_units(x.shape)
    pair = (torch._neg_view(torch.zeros(U)), torch._neg_view(torch.zeros(U)))
    lo, hi = minmax_actorder.actorder_minmax(x, layout, lambda n: pair)
    want = torch_minmax(x, layout)
    assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("size", [24, 40, 48])
def test_fewer_rows_than_threads_split_the_units_as_the_copy(size, rows, n, threads):
    """The units (not the rows) are what the threads split: a matrix of one or two rows of
    many groups is cut into as many shares of units as the copy path's row kernel cut it,
    whose starts decide which zero-ended units it reduces together."""
    threads(n)
    for seed in range(3):
        x = signed_zeros((rows, 40 * size), seed)
        layout = act_order(40 * size, size, seed)
        got = minmax_layouts.layout_minmax(x, layout)
        assert got is not None
        assert_same(got, x, layout)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [7, 16])
@pytest.mark.parametrize("size", [24, 40, 48])
def test_half_zero_units_are_reduced_in_the_widening_pieces(size, rows, dtype, n, threads):
    """bf16 / fp16 units of all zeros: the row kernel widens ``2048 // size`` of them a
    piece (not the float32 runs of 4), so the pieces the in-place pass gathers must be
    those: every zero's sign is the copy path's."""
    threads(n)
    for seed in range(3):
        x = signed_zeros((rows, 40 * size), seed).to(dtype)
        layout = act_order(40 * size, size, seed)
        assert_same(minmax_layouts.layout_minmax(x, layout), x, layout)


def ends_at_zero(shape, seed, low: bool, dtype):
    """Most values zeros of both signs, the others positive (``low``: every unit's min is a
    zero and its max not) or negative; no unit all zeros, so each unit the fast pass reads
    in another order must be reduced again for its zero's sign, not the whole chunk."""
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(shape, generator=g) + 0.5
    zero = torch.rand(shape, generator=g) < 0.7
    z = signed_zeros(shape, seed + 1000)
    x = torch.where(zero, z, v if low else -v)
    x[..., ::16] = 0.75 if low else -0.75  # (every group of 16 or more holds one)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("low", [True, False], ids=["zero min", "zero max"])
@pytest.mark.parametrize("size", [16, 24, 64])
def test_zero_ended_units_among_others_take_the_row_kernels_order(size, low, dtype):
    C = 6 * size
    for seed in range(4):
        x = ends_at_zero((16, C), seed, low, dtype)
        layout = act_order(C, size, seed)
        got = minmax_layouts.layout_minmax(x, layout)
        assert got is not None and bool(((got[0] if low else got[1]) == 0).all())
        assert_same(got, x, layout)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("size", [24, 40, 48])
def test_a_redone_chunk_starts_where_the_copys_run_starts(size, n, threads):
    """Units of all zeros after a first unit that needs no second pass: the units redone
    are reduced in the chunk the copy's row kernel put them in (from its share's start),
    not in one starting at the first unit redone."""
    threads(n)
    for seed in range(3):
        x = signed_zeros((16, 40 * size), seed)
        layout = act_order(40 * size, size, seed)
        first = torch.argsort(layout.g_idx, stable=True)[:size]
        x[0, first] = torch.arange(1.0, size + 1)  # unit 0 (of row 0, group 0): no zero
        got = minmax_layouts.layout_minmax(x, layout)
        assert float(got[0][0]) == 1.0
        assert_same(got, x, layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", [12, 20, 44, 90])
def test_nan_in_the_columns_past_the_last_whole_vector(C, dtype):
    """A matrix whose columns are no multiple of 8: the fast pass reads the last ``C % 8``
    one value at a time, and NaN there must mark its block too (NaN comparisons are false,
    so the scalar min / max would drop it): NaN exactly where the copy path has it."""
    size = next(s for s in (6, 5, 4, 3, 2) if C % s == 0)
    layout = act_order(C, size, seed=C)
    for row in (0, 5, 7, 12):
        for col in range(C - C % 8, C):
            x = torch.randn(16, C, generator=torch.Generator().manual_seed(row + col)).to(dtype)
            x[row, col] = float("nan")
            got = minmax_layouts.layout_minmax(x, layout)
            assert int(got[0].isnan().sum()) == 1 and int(got[1].isnan().sum()) == 1
            assert_same(got, x, layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_units_of_huge_or_infinite_values(dtype):
    """Units whose every value is +inf (or near float32's max): their min is that value,
    not a bound the fast pass starts from."""
    big = torch.finfo(dtype).max
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    layout = act_order(64, 8, seed=4)
    perm = torch.argsort(layout.g_idx, stable=True)
    x[:, perm[:8]] = float("inf")  # group 0 of every row
    x[:, perm[8:16]] = big  # group 1
    x[3, perm[16:24]] = -float("inf")  # group 2 of one row
    lo, hi = minmax_layouts.layout_minmax(x, layout)
    assert bool((lo[0::8] == float("inf")).all()) and bool((lo[1::8] == big).all())
    assert float(hi[3 * 8 + 2]) == -float("inf")
    assert_same((lo, hi), x, layout)
