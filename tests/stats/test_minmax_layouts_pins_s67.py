"""``stats.minmax_layouts``: behaviours a mutation round on it (s67) found unpinned: which
layouts a contiguous CPU tensor has read in place (a channel axis after the first with short
trailing runs, tiles of two rows or of a ragged last tile row), what is left to the units path
(an axis out of range), and ``unpad_minmax_`` on ranges in the units' own dtype or without a
shape, and the rows' cut of ``column_minmax`` into the shares of a slab's own threads. Expected
values are the units' min / max by their definitions (``to_units``' rows, the padding zeros
no data), the zeros' signs by the column kernel's reference (``test_column_kernel_s47``)."""

from __future__ import annotations

import pytest
import torch
from march_builds import cpu_has
from padded_layouts import tensor
from test_column_kernel_s47 import bits, reference, values

from quantscope import Block, Channel, Group, Tile, kernels
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

# (the in-place paths: skipped where no C kernel is built)
needs_kernel = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def _tiles(x, rows, cols):
    """Each tile's real values' min / max, in ``to_units`` order (tile rows, tile columns)."""
    R, C = x.shape
    tiles = [x[r:r + rows, c:c + cols] for r in range(0, R, rows) for c in range(0, C, cols)]
    return torch.stack([t.min() for t in tiles]), torch.stack([t.max() for t in tiles])


@needs_kernel
@pytest.mark.parametrize("B", [16, 24])
def test_a_channel_axis_before_short_trailing_runs_is_read_in_place(B):
    """``Channel(1)`` of a contiguous ``[A, C, B]`` whose trailing runs hold 16 values or
    more: read in place (rows of ``B``, then over ``A``), each channel's range its values'."""
    x = tensor((4096 // B * 16, 4, B), torch.float32, seed=1)
    got = minmax_layouts.layout_minmax(x, Channel(1))
    assert got is not None
    assert torch.equal(got[0], x.amin((0, 2))) and torch.equal(got[1], x.amax((0, 2)))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiles_of_two_rows_and_narrow_columns_are_read_in_place(dtype):
    """``Tile(2, 8)`` of a contiguous 256 x 256 tensor (column runs under 16 wide: the bands
    of two rows are the kernel's slabs): each tile's range, float32, in tile order."""
    x = tensor((256, 256), dtype, seed=2)
    got = minmax_layouts.layout_minmax(x, Tile(2, 8))
    assert got is not None
    want = _tiles(x.float(), 2, 8)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_kernel
def test_a_ragged_last_tile_row_of_narrow_tiles_is_read_in_place():
    """``Tile(128, 8)`` of a 300 x 256 matrix: the last tile row holds 44 rows, its tiles'
    ranges their real values' (the padding zeros are no data: all values above zero)."""
    x = tensor((300, 256), torch.float32, seed=3).abs_().add_(1.0)
    got = minmax_layouts.layout_minmax(x, Tile(128, 8))
    assert got is not None
    want = _tiles(x, 128, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_kernel
@pytest.mark.parametrize("layout", [Group(16, axis=2), Block(16, axis=-3)], ids=str)
def test_an_axis_out_of_range_is_left_to_the_units_path(layout):
    """Groups / blocks along an axis the tensor has not: no in-place result (None), so the
    units path raises its ValueError naming the axis; never the range along another axis."""
    x = tensor((256, 256), torch.float32, seed=4)
    assert minmax_layouts.layout_minmax(x, layout) is None
    with pytest.raises(ValueError, match="out of range"):
        layout.to_units(x)


def test_unpad_minmax_without_a_shape_takes_nothing_out():
    """``shape=None``: no padded parts are known; ``lo`` / ``hi`` stay as they are."""
    x = tensor((4, 40), torch.float32, seed=5)
    layout = Block(16)
    units = layout.to_units(x)
    lo, hi = units.amin(1), units.amax(1)
    lo0, hi0 = lo.clone(), hi.clone()
    assert minmax_layouts.unpad_minmax_(layout, units, None, lo, hi) == []
    assert torch.equal(lo, lo0) and torch.equal(hi, hi0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_unpad_minmax_keeps_ranges_in_the_units_own_dtype(dtype):
    """Ranges held in the units' own dtype (``torch_unit_minmax``'s): each padded block's
    becomes its real values' min / max, written in that dtype (the padding zeros no data)."""
    x = tensor((3, 40), dtype, seed=6).abs_().add_(1.0)  # above zero: padding would show
    layout = Block(16)
    units = layout.to_units(x)
    lo, hi = stats.torch_unit_minmax(units)
    assert lo.dtype == dtype
    parts = minmax_layouts.unpad_minmax_(layout, units, x.shape, lo, hi)
    assert len(parts) == 1 and parts[0][0].tolist() == [2, 5, 8]
    blocks = [x[r, c:c + 16] for r in range(3) for c in (0, 16, 32)]
    assert lo.dtype == hi.dtype == dtype
    assert torch.equal(lo, torch.stack([b.min() for b in blocks]))
    assert torch.equal(hi, torch.stack([b.max() for b in blocks]))


@needs_kernel
@pytest.mark.parametrize("kind", ["zero min", "zero max"])
def test_column_minmax_cuts_a_slabs_rows_into_its_own_threads_shares(kind, monkeypatch):
    """A matrix's columns on 16 threads (the thread floor lowered): its rows are cut into the
    16 shares that one slab of that many rows takes, not a count capped by its 8 columns, so
    the sign of a tying zero min / max is the 16-share cut's (csrc/unit_minmax.c)."""
    monkeypatch.setattr(stats, "THREAD_MIN_NUMEL", 1)
    monkeypatch.setattr(kernels, "threads", lambda requested=None: 16)
    vector = cpu_has("avx2", "f16c")
    if not vector:  # (a scalar build keeps each column's first tying zero: no cut shows)
        pytest.skip("the native build reduces no whole 8-column vectors here")
    x = values((1, 8192, 8), torch.float32, kind, seed=7)
    want = reference(x, 16, vector)
    lo, hi = minmax_layouts.column_minmax(x[0])
    assert torch.equal(bits(lo), bits(want[0][0])) and torch.equal(bits(hi), bits(want[1][0]))
    end = 0 if kind == "zero min" else 1  # (the cut shows: 8 shares give other zeros)
    assert not torch.equal(bits(reference(x, 8, vector)[end]), bits(want[end]))
