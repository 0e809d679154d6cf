"""Tiles whose last tile row or column is ragged (a side no multiple of the tile: GPT-OSS's
2880 x 2880 under DeepSeek-style fp8 ``tile:128x128``): the min-max family reads them in
place (``stats.minmax_layouts``), where ``to_units`` had zero-padded and copied the whole
tensor (18-25x a divisible shape's time, found by probing). An edge tile's range is its real
values', as the copy path leaves it once it takes the padding out: bit for bit."""

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


@settings(max_examples=60, deadline=None)
@given(lead=st.sampled_from([(), (2,)]), R=st.integers(1, 300), C=st.sampled_from(
    [16, 48, 96, 144, 288, 320, 2880 // 8]), rows=st.sampled_from([1, 8, 32, 128]),
    cols=st.sampled_from([16, 32, 64, 128]), dtype=st.sampled_from(
        [torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 99),
    bad=st.sampled_from([(), (float("nan"),), (float("inf"), -float("inf"))]))
def test_ragged_tiles_read_in_place_equal_the_padded_copy(lead, R, C, rows, cols, dtype,
                                                          seed, bad):
    x = tensor((*lead, R, C), dtype, seed, bad)
    layout = Tile(rows, cols)
    got = minmax_layouts.layout_minmax(x, layout)
    if got is None:  # too small for the kernel, or segments under 16 wide: the units path
        assert x.numel() < stats.KERNEL_MIN_NUMEL or math.gcd(C, min(cols, C)) < 16
        return
    for a, b in zip(got, copy_path(x, layout)):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
@pytest.mark.parametrize("shape,tile", [
    ((576, 1536), Tile(128, 128)), ((2, 200, 400), Tile(128, 128)), ((330, 600), Tile(64, 40)),
    ((2880, 288), Tile(128, 128)),
], ids=str)
def test_observers_read_ragged_tiles_in_place(name, shape, tile, monkeypatch):
    """No padded copy of the input (old code: ``aten.constant_pad_nd`` and the units'
    reshape), and the copy path's state, qparams and non-finite check bit for bit."""
    spec = QuantSpec("fp8_e4m3", tile)
    kw = {"averaging_constant": 0.25} if name == "minmax" else {}
    xs = [tensor(shape, torch.float32, seed) for seed in (1, 2)]
    got = quantscope.get_observer(name, spec, **kw)
    for x in xs:
        with Copies(x) as copies:
            got(x)
        assert copies.found == [], f"copied by {copies.found}"
    assert_as_units_path(monkeypatch, got, name, spec, kw, xs)
    got(tensor(shape, torch.float32, 3, bad=(float("nan"),)))
    with pytest.raises(ValueError, match="NaN or inf"):
        got.calculate_qparams()


def test_a_transposed_ragged_tile_grid_reads_in_place():
    """A transposed matrix's tiles (the memory's ``cols x rows`` tiles, grid transposed)
    take the ragged edges too."""
    x = tensor((288, 2880), torch.float32, 4).t()
    got = minmax_layouts.layout_minmax(x, Tile(128, 128))
    assert got is not None
    for a, b in zip(got, copy_path(x, Tile(128, 128))):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("layout,shape", [(Tile(128, 128), (300, 256)),
                                          (Block(16), (64, 1000))], ids=str)
def test_off_the_cpu_padded_units_are_left_to_the_units_path(layout, shape):
    """Off the CPU the op reads the padded units, zeros included: forward takes the padding
    out on the units path, so the direct path gives none for them there."""
    meta = torch.empty(shape, device="meta")
    assert minmax_layouts.layout_minmax(meta, layout) is None
    whole = torch.empty(256, 256, device="meta")  # no padding: the op reads the units
    assert minmax_layouts.layout_minmax(whole, Tile(128, 128)) is not None
