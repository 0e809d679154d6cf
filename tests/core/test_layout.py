"""Layouts: to_units / to_shape round trip (property test), qparam shapes, unit contents, errors."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantscope.layout import Block, Channel, Group, Tensor, Tile, Token, parse_layout


@st.composite
def tensor_and_layout(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    kind = draw(st.sampled_from(["tensor", "channel", "group", "group_gidx", "token", "block",
                                 "tile"] if ndim >= 2 else
                                ["tensor", "channel", "group", "group_gidx", "token", "block"]))
    axis = draw(st.integers(-ndim, ndim - 1))
    n = shape[axis]
    if kind == "tensor":
        layout = Tensor()
    elif kind == "channel":
        layout = Channel(axis)
    elif kind == "token":
        layout = Token()
    elif kind.startswith("group"):
        size = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
        g_idx = None
        if kind == "group_gidx":
            perm = draw(st.permutations(range(n)))
            g_idx = (torch.tensor(perm) // size).to(torch.int32)  # shuffled, `size` per group
        layout = Group(size, axis, g_idx)
    elif kind == "block":
        layout = Block(draw(st.integers(1, 9)), axis)
    else:
        layout = Tile(draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    # distinct integer values: sums are exact, so unit contents can be fingerprinted
    x = torch.randperm(math.prod(shape), generator=torch.Generator().manual_seed(
        draw(st.integers(0, 2**16)))).float().add_(1).reshape(shape)
    return x, layout


def expected_qparam_shape(layout, shape):
    nd = len(shape)
    if isinstance(layout, Tensor):
        return (1,)
    if isinstance(layout, Channel):
        a = layout.axis % nd
        return tuple(n if i == a else 1 for i, n in enumerate(shape))
    if isinstance(layout, Token):
        return (*shape[:-1], 1)
    if isinstance(layout, (Group, Block)):
        a = layout.axis % nd
        rest = shape[:a] + shape[a + 1:]
        return (*rest, -(-shape[a] // layout.size))
    return (*shape[:-2], -(-shape[-2] // layout.rows), -(-shape[-1] // layout.cols))


def reference_unit_sums(x, layout):
    """Per-unit sums computed directly from the tensor, in qparam shape (independent of to_units)."""
    nd = x.dim()
    if isinstance(layout, Tensor):
        return x.sum().reshape(1)
    if isinstance(layout, Channel):
        a = layout.axis % nd
        others = [d for d in range(nd) if d != a]
        return x.sum(dim=others, keepdim=True) if others else x.clone()  # dim=[] sums all
    if isinstance(layout, Token):
        return x.sum(-1, keepdim=True)
    if isinstance(layout, (Group, Block)):
        m = x.movedim(layout.axis % nd, -1)
        n = m.shape[-1]
        if isinstance(layout, Group) and layout.g_idx is not None:
            group_of = layout.g_idx.long()
        else:
            group_of = torch.arange(n) // layout.size
        count = -(-n // layout.size)
        out = torch.zeros(*m.shape[:-1], count)
        return out.index_add_(-1, group_of, m)
    r, c = x.shape[-2:]
    rows = torch.arange(r) // layout.rows
    cols = torch.arange(c) // layout.cols
    rt, ct = -(-r // layout.rows), -(-c // layout.cols)
    out = torch.zeros(*x.shape[:-2], rt, c).index_add_(-2, rows, x)
    return torch.zeros(*x.shape[:-2], rt, ct).index_add_(-1, cols, out)


@settings(max_examples=300, deadline=None)
@given(tensor_and_layout())
def test_round_trip_shapes_and_unit_contents(case):
    x, layout = case
    units = layout.to_units(x)
    shape = tuple(x.shape)
    qshape = layout.qparam_shape(shape)
    assert qshape == expected_qparam_shape(layout, shape)
    assert units.dim() == 2 and units.shape[0] == layout.num_units(shape) == math.prod(qshape)
    assert torch.equal(layout.to_shape(units, x.shape), x)
    # row i of the units view is the unit at flat position i of the qparam tensor
    assert torch.equal(units.sum(1).reshape(qshape), reference_unit_sums(x, layout))
    # padding is zeros and only where the layout pads
    assert units.numel() >= x.numel()
    if not layout.pads:
        assert units.numel() == x.numel()
    assert units.sum() == x.sum()
    # a per-unit value broadcast back lands on its own elements
    ids = torch.arange(units.shape[0], dtype=torch.float32)[:, None].expand_as(units)
    back = layout.to_shape(ids, x.shape)
    assert torch.equal(layout.to_units(back)[units != 0], ids[units != 0])


def test_group_gidx_is_a_column_permutation():
    """g_idx: columns with the same group id share a unit, in column order (stable argsort)."""
    g_idx = torch.tensor([1, 0, 1, 0, 2, 2])
    x = torch.arange(12.0).reshape(2, 6)
    u = Group(2, g_idx=g_idx).to_units(x)
    assert u.tolist() == [[1, 3], [0, 2], [4, 5], [7, 9], [6, 8], [10, 11]]
    assert Group(2, g_idx=g_idx) == Group(2)  # g_idx does not enter equality / hashing


def test_block_and_tile_pad_with_zeros():
    x = torch.arange(1.0, 6.0)
    assert Block(4).to_units(x).tolist() == [[1, 2, 3, 4], [5, 0, 0, 0]]
    t = Tile(2, 2).to_units(torch.arange(1.0, 10.0).reshape(3, 3))
    assert t.tolist() == [[1, 2, 4, 5], [3, 0, 6, 0], [7, 8, 0, 0], [9, 0, 0, 0]]
    assert Block(4).pads and Tile().pads and not Group(4).pads


def test_a_tile_past_a_whole_dim_is_cut_to_it():
    # a decode-shaped [B, 1, C] activation: one row per tile, not 128 rows of them padding
    x = torch.arange(1.0, 1 + 3 * 300).reshape(3, 1, 300)
    lay = Tile(128, 128)
    u = lay.to_units(x)
    assert u.shape == (3 * 3, 128) and lay.qparam_shape(x.shape) == (3, 1, 3)
    assert u[:3].tolist() == [x[0, 0, :128].tolist(), x[0, 0, 128:256].tolist(),
                              x[0, 0, 256:].tolist() + [0.0] * 84]  # the column edge pads
    assert torch.equal(lay.to_shape(u, x.shape), x) and lay.pads_at(x.shape)
    assert [p.shape for _, p in lay.padded_parts(u, x.shape)] == [(3, 44)]
    small = torch.arange(1.0, 16.0).reshape(3, 5)  # smaller than one tile: one unit, no padding
    assert lay.to_units(small).tolist() == [small.reshape(-1).tolist()]
    assert not lay.pads_at(small.shape) and lay.padded_parts(lay.to_units(small), (3, 5)) == []


@pytest.mark.parametrize("make,shape,match", [
    (lambda: Group(0), None, "Group: size"),
    (lambda: Group(-4), None, "Group: size"),
    (lambda: Block(0), None, "Block: size"),
    (lambda: Group(2.5), None, "Group: size"),
    (lambda: Group(True), None, "Group: size must be a positive integer, got True"),
    (lambda: Block(True), None, "Block: size must be a positive integer, got True"),
    (lambda: Tile(True, 4), None, "Tile: rows must be a positive integer, got True"),
    (lambda: Tile(0, 4), None, "Tile: rows"),
    (lambda: Tile(4, -1), None, "Tile: cols"),
    (lambda: Group(3), (4, 8), "Group: size 3 does not divide 8"),
    (lambda: Channel(2), (4, 8), "Channel: axis 2 is out of range"),
    (lambda: Channel(-3), (4, 8), "Channel: axis -3"),
    (lambda: Group(4, axis=5), (4, 8), "Group: axis 5"),
    (lambda: Block(4, axis=-3), (4, 8), "Block: axis -3"),
    (lambda: Tile(2, 2), (8,), "Tile: needs a tensor of at least 2 dims"),
    (lambda: Channel(0), (), "Channel: a 0-d"),
    (lambda: Group(2, g_idx=torch.tensor([0, 0, 1])), None,
     r"Group: g_idx must hold one group index per column, a multiple of size=2 of them; got 3"),
    # s48 docs probe: a g_idx cut short (a damaged file) had been said as "each group 0..-1"
    (lambda: Group(64, g_idx=torch.arange(5)), None,
     r"g_idx must hold one group index per column, a multiple of size=64 of them; got 5"),
    (lambda: Group(2, g_idx=torch.tensor([0, 0, 0, 1])), None, "Group: g_idx must put exactly"),
    # a damaged g_idx's huge id is refused before any count (bincount allocated 8 bytes per id)
    (lambda: Group(2, g_idx=torch.tensor([0, 0, 1, 2**40])), None,
     r"g_idx must put exactly size=2 columns in each group 0..1; got group index 1099511627776"),
    (lambda: Group(2, g_idx=torch.tensor([0.0, 0.0])), None, "Group: g_idx must be a 1-D integer"),
    (lambda: Group(2, g_idx=torch.tensor([0, 0, 1, 1])), (3, 8), "Group: g_idx has 4 entries"),
])
def test_errors_name_the_argument(make, shape, match):
    with pytest.raises(ValueError, match=match):
        layout = make()
        layout.check(shape)


@pytest.mark.parametrize("make", [
    lambda: Channel("0"), lambda: Channel(1.0), lambda: Channel(True), lambda: Channel(None),
    lambda: Group(4, axis="a"), lambda: Group(4, axis=False), lambda: Block(32, axis=1.0),
])
def test_axis_must_be_an_integer(make):
    # checked at construction, not left to fail (or silently pass, True == 1) at use
    with pytest.raises(ValueError, match="axis must be an integer"):
        make()


def test_axis_accepts_numpy_and_torch_integers():
    assert Channel(np.int64(1)) == Channel(1) and type(Channel(np.int64(1)).axis) is int
    assert Group(4, axis=np.int32(0)).spec_name() == "group:4:0"
    assert Block(8, axis=torch.tensor(0)).qparam_shape((16, 3)) == (3, 2)


def test_parse_layout():
    assert parse_layout("tensor") == Tensor() and parse_layout("token") == Token()
    assert parse_layout("channel") == Channel(0) and parse_layout("channel:1") == Channel(1)
    assert parse_layout("group:128") == Group(128) and parse_layout("group:64:0") == Group(64, 0)
    assert parse_layout("block") == Block(32) and parse_layout("block:16") == Block(16)
    assert parse_layout("tile:128x64") == Tile(128, 64) and parse_layout("tile") == Tile(128, 128)
    layout = Channel(1)
    assert parse_layout(layout) is layout
    for bad, match in (("rows", "layout: unknown"), ("group:x", "layout: cannot read"),
                       ("group:0", "Group: size"), ("group", "a group needs its size"),
                       ("group::0", "a group needs its size")):  # (Group has no default)
        with pytest.raises(ValueError, match=match):
            parse_layout(bad)


def test_layout_kind_registers_and_names_round_trip():
    # the layout class owns its name: parse_layout reads what spec_name writes
    from quantscope.layout import LAYOUTS

    assert set(LAYOUTS) == {"tensor", "channel", "token", "group", "block", "tile"}
    for lay in (Tensor(), Channel(1), Token(), Group(64), Group(8, 0), Block(16), Tile(64, 32)):
        assert parse_layout(lay.spec_name()) == lay
    assert Group(128).spec_name() == "group:128" and Tile().spec_name() == "tile:128x128"


def test_a_specs_string_marks_act_order_groups():
    """Refusals and report rows print str(spec): act-order groups read as plain ones."""
    from quantscope import QuantSpec

    moved, kept = torch.tensor([1, 0, 1, 0]), torch.tensor([0, 0, 1, 1])  # kept: no move
    assert str(QuantSpec("int4", Group(2, g_idx=moved))) == "int4 group:2 act-order sym"
    assert str(QuantSpec("int4", Group(2, g_idx=kept))) == str(QuantSpec("int4", Group(2)))
    assert str(QuantSpec("int4", Group(2))) == "int4 group:2 sym"
