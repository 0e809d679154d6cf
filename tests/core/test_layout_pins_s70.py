"""Pins from session 70's mutation round of layout.py: empty and 0-d tensors under Channel and
Token, ``pads_at`` read from the shape, the checks of ``g_idx`` (2-D, negative ids, numpy
input), the square ``"tile:N"`` name, tile runs in ``same_units``, a layout's own errors kept
unwrapped by ``parse_layout`` and names read in any case. Each test holds a behaviour that a
small mutant of the source broke while every other test of the module still passed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantscope.layout import Block, Channel, Group, Tensor, Tile, Token, parse_layout


@pytest.mark.parametrize("shape,axis", [((0, 3), 0), ((3, 0), 1), ((2, 0, 4), 1)])
def test_a_channel_axis_of_size_zero_gives_zero_units(shape, axis):
    """An empty channel axis is no division by zero: no units, and the round trip holds."""
    x, lay = torch.empty(shape), Channel(axis)
    units = lay.to_units(x)
    assert units.shape[0] == lay.num_units(shape) == 0
    assert lay.to_shape(units, shape).shape == shape


def test_a_0d_tensor_is_one_token_of_one_value():
    """Token of a 0-d tensor: one unit holding the value, qparam shape ``(1,)``."""
    x = torch.tensor(3.0)
    assert Token().to_units(x).tolist() == [[3.0]]
    assert Token().qparam_shape(()) == (1,) and Token().num_units(()) == 1
    assert torch.equal(Token().to_shape(Token().to_units(x), ()), x)


@pytest.mark.parametrize("layout,shape,pads", [
    (Block(4), (3, 8), False), (Block(4), (3, 7), True), (Block(4, axis=0), (8, 3), False),
    (Block(4, axis=0), (6, 3), True), (Group(4), (3, 8), False), (Tensor(), (3, 7), False),
    (Channel(1), (3, 7), False), (Token(), (3, 7), False)])
def test_pads_at_says_whether_this_shape_leaves_padding(layout, shape, pads):
    """Blocks carry padding only where the size does not divide the axis; the others never."""
    assert layout.pads_at(shape) is pads
    units = layout.to_units(torch.ones(shape))
    assert (units.numel() > torch.Size(shape).numel()) is pads


@pytest.mark.parametrize("g_idx,match", [
    (torch.tensor([[0, 0], [1, 1]]), r"g_idx must be a 1-D integer tensor, .* shape \(2, 2\)"),
    (torch.tensor([-1, -1, 0, 0]), r"g_idx must hold group indices >= 0, got -1"),
])
def test_a_g_idx_that_is_not_1d_or_holds_negative_ids_is_refused(g_idx, match):
    """g_idx is one non-negative group id per column: a ValueError names what is wrong."""
    with pytest.raises(ValueError, match=match):
        Group(2, g_idx=g_idx)


def test_a_numpy_g_idx_is_kept_as_a_tensor():
    """A checkpoint's g_idx read as numpy is converted once: the layout checks and uses it."""
    lay = Group(2, g_idx=np.array([1, 0, 1, 0], dtype=np.int32))
    assert isinstance(lay.g_idx, torch.Tensor) and lay.g_idx.tolist() == [1, 0, 1, 0]
    assert lay.qparam_shape((3, 4)) == (3, 2)
    assert lay.to_units(torch.arange(4.0)).tolist() == [[1.0, 3.0], [0.0, 2.0]]
    with pytest.raises(ValueError, match="Group: g_idx has 4 entries"):
        lay.check((3, 6))


def test_a_tile_of_one_size_is_square():
    """``"tile:N"`` is N x N tiles (as ``"tile"`` is 128 x 128)."""
    assert parse_layout("tile:64") == Tile(64, 64)
    assert parse_layout("tile:16").qparam_shape((32, 64)) == (2, 4)


def test_tiles_of_other_columns_are_not_the_same_units():
    """2x5 and 2x6 tiles of a 4x10 tensor share a qparam shape (2, 2) but not their units."""
    a, b = Tile(2, 5), Tile(2, 6)
    assert a.qparam_shape((4, 10)) == b.qparam_shape((4, 10))
    assert not a.same_units(b, (4, 10)) and not b.same_units(a, (4, 10))
    assert a.same_units(Tile(2, 5), (4, 10))


@pytest.mark.parametrize("name,message", [
    ("group:0", "Group: size must be a positive integer, got 0"),
    ("block:0", "Block: size must be a positive integer, got 0"),
    ("tile:0x4", "Tile: rows must be a positive integer, got 0"),
])
def test_parse_layout_passes_a_layouts_own_error_on_unwrapped(name, message):
    """A layout's own refusal already names it: parse_layout raises it as it is."""
    with pytest.raises(ValueError) as info:
        parse_layout(name)
    assert str(info.value) == message


@pytest.mark.parametrize("name,layout", [
    ("GROUP:128", Group(128)), ("Tile:64x32", Tile(64, 32)), ("Channel:1", Channel(1)),
    ("TOKEN", Token())])
def test_parse_layout_reads_names_in_any_case(name, layout):
    """Layout names are read case-insensitively."""
    assert parse_layout(name) == layout
