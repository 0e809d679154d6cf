"""``stats.minmax_layouts``: cases a mutation round on it found untested (s48)."""

from __future__ import annotations

import math

import pytest
import torch
from padded_layouts import bits, copy_path, tensor

import quantscope
from quantscope import Block, QuantSpec
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
def test_column_minmax_of_no_rows_is_the_empty_min_and_max(dtype):
    """No rows: each column's min is +inf and its max -inf (the identities of min / max, so
    a running range taking it stays as it was), in the result dtype of every other call."""
    lo, hi = minmax_layouts.column_minmax(torch.empty(0, 5, dtype=dtype))
    want = minmax_layouts.column_minmax(torch.ones(3, 5, dtype=dtype))[0].dtype
    assert lo.shape == hi.shape == (5,) and lo.dtype == hi.dtype == want
    assert bool((lo == math.inf).all()) and bool((hi == -math.inf).all())


# (the kernel paths: skipped where no C kernel is built)
needs_kernel = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


@needs_kernel
@pytest.mark.parametrize("lead", [2, 3])
def test_ragged_blocks_along_an_inner_axis_of_several_leading_indices(lead, monkeypatch):
    """Blocks along axis 1 of a 3-d tensor whose size (40) they do not divide, with several
    leading indices: the padded units' ranges are their real values' (the copy path's), or
    the units path takes them (None); never an error."""
    monkeypatch.setattr(stats, "KERNEL_MIN_NUMEL", 0)  # the kernel paths from small inputs on
    layout = Block(16, axis=1)
    for dtype in (torch.float32, torch.bfloat16):
        x = tensor((lead, 40, 32), dtype, seed=lead)
        got = minmax_layouts.layout_minmax(x, layout)
        if got is not None:
            want = copy_path(x, layout)
            assert torch.equal(bits(got[0]), bits(want[0]))
            assert torch.equal(bits(got[1]), bits(want[1]))
        obs = quantscope.get_observer("memoryless_minmax", QuantSpec("fp8_e4m3", layout))
        obs(x)
        want = copy_path(x, layout)
        assert torch.equal(bits(obs.min_vals), bits(want[0]))


PAIRS = {"one of another size": lambda U: (torch.full((U,), 9.0), torch.full((U + 1,), 9.0)),
         "negative views": lambda U: (torch._neg_view(torch.zeros(U)),
                                      torch._neg_view(torch.zeros(U)))}


@needs_kernel
@pytest.mark.parametrize("pair", PAIRS)
def test_out_for_pairs_that_do_not_both_fit_are_left_alone(pair):
    """Runs of a transposed weight's rows (``w.t()``, blocks along its memory's rows) into
    ``out_for``'s pair only where both fit, as plain float32 memory: one of another size,
    or views whose memory is not their values (``torch._neg_view``), take new tensors."""
    w = tensor((512, 384), torch.float32, seed=5)
    layout = Block(16)
    U = layout.num_units(w.t().shape)
    units = layout.to_units(w.t())
    out = PAIRS[pair](U)
    lo, hi = minmax_layouts.layout_minmax(w.t(), layout, lambda n: out)
    assert torch.equal(lo, units.amin(1)) and torch.equal(hi, units.amax(1))


def test_tiles_of_a_ragged_last_dim_keep_the_edge_tiles():
    """``tile:128x128`` of a 256 x 300 weight (the kernel's band path: 300 is no multiple of
    128): three tile columns per band, the last 44 wide, its range its real values' (the
    padding zeros are no data), in ``to_units`` order (tile rows, then tile columns)."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(256, 300, generator=g) + 1.0  # all above zero: padding would show
    lo, hi = minmax_layouts.layout_minmax(x, quantscope.Tile(128, 128))
    tiles = [x[r:r + 128, c:c + 128] for r in (0, 128) for c in (0, 128, 256)]
    assert torch.equal(lo, torch.stack([t.min() for t in tiles]))
    assert torch.equal(hi, torch.stack([t.max() for t in tiles]))


def test_non_square_tiles_of_a_transposed_weight_read_in_place():
    """``x = w.t()`` read from ``w``'s memory: ``x``'s 64 x 128 tiles are ``w``'s 128 x 64
    ones (rows and columns swapped with the axes), their grid transposed back into ``x``'s
    tile order: each unit's range is that of ``x[r:r + 64, c:c + 128]``."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 384, generator=g).t()  # [384, 256], not contiguous
    lo, hi = minmax_layouts.layout_minmax(x, quantscope.Tile(64, 128))
    tiles = [x[r:r + 64, c:c + 128] for r in range(0, 384, 64) for c in (0, 128)]
    assert torch.equal(lo, torch.stack([t.min() for t in tiles]))
    assert torch.equal(hi, torch.stack([t.max() for t in tiles]))
