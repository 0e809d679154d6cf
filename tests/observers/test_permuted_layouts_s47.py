"""Mutation round s47 on ``stats.minmax_layouts``: cases the property test (2-D tiles only,
runs dividing their axis) does not reach. A permuted tensor of three or four dims whose
groups / blocks come back through a non-trivial permutation, a run axis innermost in
memory with a padded tail (read in place), tiles of a tensor whose leading dims (not its last two) are
permuted, and blocks along the first axis of a contiguous tensor with a padded tail: each
equals the units path (``to_units``, its padding taken out) bit for bit."""

from __future__ import annotations

import pytest
import torch

import quantscope
from quantscope import Block, Group, QuantSpec, Tile
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().nan_to_num(7.0).view(torch.int32)


def permuted(mem_shape, perm, dtype=torch.float32, seed=0):
    """``mem`` (contiguous, ``mem_shape``) viewed as ``mem.permute(perm)``, no zeros."""
    g = torch.Generator().manual_seed(seed)
    mem = torch.rand(mem_shape, generator=g).add_(0.5)
    mem *= torch.randint(0, 2, mem.shape, generator=g) * 2 - 1.0
    mem.view(-1)[::997] = float("inf")
    return mem.to(dtype).permute(perm)


def reference(x, layout):
    """Per-unit (lo, hi) from the units path: a contiguous copy's units, padding out."""
    units = layout.to_units(x.contiguous())
    lo, hi = stats.torch_unit_minmax(units)
    lo, hi = lo.float(), hi.float()
    minmax_layouts.unpad_minmax_(layout, units, x.shape, lo, hi)
    return lo, hi


def check(x, layout, in_place: bool):
    got = minmax_layouts.layout_minmax(x, layout)
    assert (got is not None) == in_place
    want = reference(x, layout)
    if got is not None:
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(bits(a), bits(b))
    # and through an observer (forward's own choice of path)
    spec = QuantSpec("int8", layout)
    obs = quantscope.get_observer("memoryless_minmax", spec)
    obs(x)
    assert torch.equal(bits(obs.min_vals), bits(want[0]))
    assert torch.equal(bits(obs.max_vals), bits(want[1]))


# (memory shape, permutation giving x, layout): runs whose units come back through a
# permutation of three or four axes (the grid's order matters there)
RUNS = [
    ((32, 48, 64), [2, 0, 1], Group(8, 1)),
    ((32, 48, 64), [2, 0, 1], Block(16, 2)),
    ((32, 48, 64), [1, 2, 0], Group(16, 0)),
    ((4, 24, 24, 32), [0, 3, 1, 2], Group(8, 1)),
    ((4, 24, 24, 32), [0, 3, 1, 2], Block(4, 3)),
    ((8, 16, 32, 24), [0, 2, 1, 3], Group(4, 0)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mem_shape,perm,layout", RUNS, ids=str)
def test_permuted_runs_of_three_or_four_axes(mem_shape, perm, layout, dtype):
    x = permuted(mem_shape, perm, dtype)
    assert not x.is_contiguous()
    check(x, layout, in_place=True)


def test_run_axis_innermost_in_memory_with_a_padded_tail():
    # x (48, 32, 48): its axis 0 is the memory's last; 48 % 32 leaves a padded tail
    x = permuted((32, 48, 48), [2, 0, 1])
    check(x, Block(32, 0), in_place=True)  # (a Group must divide its axis: refused)


def test_tiles_of_a_tensor_whose_leading_dims_are_permuted():
    # x (16, 32, 160) from memory (32, 16, 160): the last two dims are in place, the
    # leading ones swapped: no transposed-tile view of it (the units path reads it)
    x = permuted((32, 16, 160), [1, 0, 2])
    for layout in (Tile(16, 32), Tile(8, 160), Tile(32, 16)):
        check(x, layout, in_place=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_contiguous_blocks_along_the_first_axis_with_a_padded_tail(dtype):
    # 300 % 32 == 12: the last block of each column is padded (read in place, its real
    # values' range, as the units path takes the padding out)
    x = permuted((300, 256), [0, 1], dtype)
    assert x.is_contiguous()
    check(x, Block(32, 0), in_place=True)
