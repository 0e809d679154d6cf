"""Blocks whose last block along their axis is zero-padded (a side no multiple of the block:
``block:128`` of a 4000-wide weight, MXFP4 / NVFP4 blocks along a transposed weight's rows):
the min-max family reads them in place (``stats.minmax_layouts``), where ``to_units`` padded
and copied the whole tensor first (``torch.nn.functional.pad``: 12-14x a divisible shape's
time along axis 0, 22-37x on ``w.t()``, 3-11x along the last axis, found by probing). A padded
block's range is its real values', as the copy path leaves it once it takes the padding out:
bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_names import Copies
from padded_layouts import assert_as_units_path, bits, copy_path, tensor

import quantscope
from quantscope import Block, QuantSpec, Tile
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def in_place(shape, size, axis) -> bool:
    """Whether the blocks of a tensor of ``shape`` (contiguous, or the transpose of one)
    are read in place: runs along an axis before the last for one leading index (slabs of
    at least 16 columns), or along the last by one pass where the tail is under 32 values
    (test_padded_rows_s48), else in segments ``gcd`` wide (at least 16)."""
    a = axis % len(shape)
    if a == len(shape) - 1:  # (a block wider than the axis: the axis)
        return shape[a] % size < 32 or math.gcd(shape[a], min(size, shape[a])) >= 16
    return math.prod(shape[:a]) == 1 and math.prod(shape[a + 1:]) >= 16


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from([(300, 260), (260, 300), (1000, 72), (72, 1000), (3, 130, 200)]),
       size=st.sampled_from([16, 32, 48, 128]), axis=st.integers(-3, 2),
       transposed=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 99),
       bad=st.sampled_from([(), (float("nan"),), (float("inf"), -float("inf"))]))
def test_padded_blocks_read_in_place_equal_the_padded_copy(shape, size, axis, transposed, dtype,
                                                           seed, bad):
    if not -len(shape) <= axis < len(shape) or (transposed and len(shape) != 2):
        return
    x = tensor(shape[::-1] if transposed else shape, dtype, seed, bad)
    x = x.t() if transposed else x
    layout = Block(size, axis)
    if not layout.pads_at(x.shape):
        return
    got = minmax_layouts.layout_minmax(x, layout)
    memory = x.t() if transposed else x  # the memory's own order
    mem_axis = (1 - axis % 2) if transposed else axis
    assert (got is not None) == in_place(memory.shape, size, mem_axis)
    if got is None:
        return
    for a, b in zip(got, copy_path(x, layout)):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
@pytest.mark.parametrize("shape,spec,transposed", [
    ((1000, 1000), QuantSpec("int4", Block(128, 0)), False),
    ((300, 1040), QuantSpec("int4", Block(128)), False),
    ((1000, 1040), QuantSpec("int4", Block(128)), True),
    ((512, 2050), QuantSpec("fp4_e2m1", Block(32)), True),
], ids=str)
def test_observers_read_padded_blocks_in_place(name, shape, spec, transposed, monkeypatch):
    """No padded copy of the input (old code: ``aten.constant_pad_nd`` and the units'
    reshape), and the copy path's state, qparams and non-finite check bit for bit."""
    kw = {"averaging_constant": 0.25} if name == "minmax" else {}
    make = lambda seed, bad=(): (tensor(shape[::-1], torch.float32, seed, bad).t()
                                 if transposed else tensor(shape, torch.float32, seed, bad))
    xs = [make(seed) for seed in (1, 2)]
    got = quantscope.get_observer(name, spec, **kw)
    for x in xs:
        with Copies(x) as copies:
            got(x)
        assert copies.found == [], f"copied by {copies.found}"
    assert_as_units_path(monkeypatch, got, name, spec, kw, xs)
    got(make(3, bad=(float("nan"),)))
    with pytest.raises(ValueError, match="NaN or inf"):
        got.calculate_qparams()


@pytest.mark.parametrize("shape,tile", [
    ((300, 1000), Tile(128, 128)), ((2, 256, 1000), Tile(128, 128)), ((4000, 200), Tile(128, 72)),
    ((600, 2049), Tile(64, 64)),
], ids=str)
def test_ragged_tiles_of_any_width_read_in_place(shape, tile):
    """Bands of tile rows through the column kernel: a width sharing no 16-wide segment with
    the tile (``gcd < 16``: the units path padded and copied these) reads in place, the copy
    path's values bit for bit."""
    x = tensor(shape, torch.float32, 5, bad=(float("nan"),))
    with Copies(x) as copies:
        got = minmax_layouts.layout_minmax(x, tile)
    assert got is not None and copies.found == [], copies.found
    for a, b in zip(got, copy_path(x, tile)):
        assert torch.equal(bits(a), bits(b))
