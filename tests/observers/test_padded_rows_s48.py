"""Blocks along the last axis of a width no multiple of the block whose row segments
``gcd(width, block)`` are under 16 wide: MXFP4 / NVFP4 blocks of a 2050- or 4008-wide weight
(segments 2 / 8 wide), BFP16's of a 4001-wide one. One C pass reads them where they lie
(``qs_padded_minmax``, ``stats.minmax_layouts``), where ``to_units`` had padded and copied the
whole tensor (11-13x a divisible width's CPU time in float32, 2.4-4.0x in bf16, found by
probing). Its ranges are the observers' units path's bit for bit: the row kernel's on the
padded copy (NaN, and the sign of a -0.0 / +0.0 tie: which of its lane orders a block meets,
as the threads' shares and its quads of rows fall), and a padded block's its real values',
as ``unpad_minmax_`` leaves it."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_names import Copies
from padded_layouts import assert_as_units_path, bits, kernel_copy_path, ties

import quantscope
from quantscope import Block, presets
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")

BAD = [(), (float("nan"),), (float("inf"), -float("inf")), (float("nan"),) * 9]


def equal(got, want) -> bool:
    return all(a.dtype == torch.float32 and torch.equal(bits(a), bits(b))
               for a, b in zip(got, want))


@settings(max_examples=80, deadline=None)
@given(size=st.sampled_from([8, 16, 24, 32, 64, 128]), blocks=st.sampled_from([0, 1, 3, 64]),
       tail=st.integers(1, 31), more=st.integers(0, 40), threads=st.sampled_from([1, 2, 3, 5]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 99), bad=st.sampled_from(BAD))
def test_padded_rows_read_in_place_equal_the_units_path(size, blocks, tail, more, threads,
                                                        dtype, seed, bad):
    """Widths ``blocks * size + tail`` (one block narrower than the width too), from 2 rows
    up, every tail of fewer than 32 values, on odd thread counts (the units path's shares:
    ``THREAD_MIN_NUMEL`` lowered so that small tensors split too), into the memory
    ``out_for`` gives (no new tensor as large as ``x``: its one-value rows have as many
    units)."""
    tail = tail % size or 1
    W = blocks * size + tail
    R = max(2, stats.KERNEL_MIN_NUMEL // W + 1) + more
    x = ties((R, W), dtype, seed, bad)
    U = Block(size).num_units(x.shape)
    out = torch.empty(U), torch.empty(U)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(stats, "THREAD_MIN_NUMEL", 1 << 12):
            with Copies(x) as copies:
                got = minmax_layouts.layout_minmax(x, Block(size), lambda n: out)
            want = kernel_copy_path(x, Block(size))
    finally:
        torch.set_num_threads(before)
    assert got is not None and copies.found == [], copies.found
    assert got[0] is out[0] and got[1] is out[1] and out[0]._version > 0  # (the C's writes)
    assert equal(got, want)


#: a block whose -0.0 / +0.0 tie the row kernel settles apart in a quad of rows (-0.0) and in
#: a share's last rows, one at a time (+0.0): which of them a unit meets is the share cut's
TIE = torch.tensor([-0.0, 1.0, -0.0, -0.0, -0.0, 0.0, -0.0, 1.0, 0.0, -0.0, 1.0, 0.0, 0.0, 1.0,
                    0.0, 0.0, 1.0, -0.0, 0.0, 0.0, -0.0, 0.0, 0.0, -0.0, -0.0, -0.0, 1.0, 1.0,
                    -0.0, 0.0, 1.0, 1.0])


@pytest.mark.parametrize("rows, threads", [(2, 3), (2, 5), (3, 4), (3, 5)])
def test_fewer_rows_than_threads_cut_the_units_shares(rows, threads):
    """A few long rows on more threads than rows (a 3 x 41026 activation on 4 threads): the
    pass cuts its units into the shares the units path's row kernel takes on the padded copy
    (``_threads(U * size, U)``), so each zero's sign is the units path's, bit for bit (mutant
    R03 of s50: shares cut by rows, which the property test's 8 rows or more never met)."""
    W = 1282 * 32 + 2
    xs = [torch.cat((TIE.repeat(rows, 1282), torch.full((rows, 2), 0.5)), 1)]
    xs += [ties((rows, W), torch.float32, seed) for seed in range(3)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(stats, "THREAD_MIN_NUMEL", 1 << 12):
            for x in xs:
                got = minmax_layouts.layout_minmax(x, Block(32))
                assert got is not None and equal(got, kernel_copy_path(x, Block(32)))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lead", [(), (3,)], ids=str)
def test_one_pass_over_a_weight_and_a_transposed_one(lead, dtype):
    """Leading dims are rows too; a transposed weight whose memory's rows hold the padded
    blocks (blocks along its axis 0) reads them the same way, its units then reordered."""
    x = ties((*lead, 40, 2050), dtype, 3, (float("nan"),))
    for layout, t in ((presets.MXFP4.layout, x), (presets.NVFP4.layout, x),
                      (Block(16, -2), x.transpose(-1, -2))):
        with Copies(t) as copies:
            got = minmax_layouts.layout_minmax(t, layout)
        assert got is not None and copies.found == [], (layout, copies.found)
        assert equal(got, kernel_copy_path(t, layout))


def test_a_padded_blocks_range_is_its_real_values():
    """The padding is no data: a tail of negative values has a negative max, one of
    positive values a positive min; a -0.0 / +0.0 tie in a tail keeps its first zero."""
    x = torch.full((64, 2050), 5.0)
    x[0, -2:] = torch.tensor([-3.0, -1.5])
    x[1, -2:] = torch.tensor([2.5, 7.0])
    x[2, -2:] = torch.tensor([-0.0, 0.0])
    x[3, -2:] = torch.tensor([0.0, -0.0])
    lo, hi = minmax_layouts.layout_minmax(x, Block(32))
    ends = [(lo[i * 65 + 64].item(), hi[i * 65 + 64].item()) for i in range(4)]
    assert ends == [(-3.0, -1.5), (2.5, 7.0), (0.0, 0.0), (0.0, 0.0)]
    signs = [(lo[i * 65 + 64].signbit().item(), hi[i * 65 + 64].signbit().item())
             for i in (2, 3)]
    assert signs == [(True, True), (False, False)]
    assert lo[0].item() == hi[0].item() == 5.0


def test_what_the_pass_leaves_to_the_units_path():
    """Tails of 32 values or more (``unpad_minmax_``'s torch reduction takes them in its
    vector lanes' order), a single row (a whole-tensor reduction), blocks longer than the
    kernel's buffer: None (the units path), or row segments where they are 16 wide."""
    x = ties((700, 4000), torch.float32, 1)
    assert minmax_layouts.layout_minmax(x, Block(128)) is not None  # (4000 % 128: segments)
    assert minmax_layouts.layout_minmax(ties((700, 4001), torch.float32, 1), Block(64)) is None
    assert minmax_layouts.layout_minmax(ties((1, 70001), torch.float32, 1), Block(32)) is None
    assert minmax_layouts.layout_minmax(ties((30, 4100), torch.float32, 1), Block(4096)) is None


@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax", "minmax"])
@pytest.mark.parametrize("spec,shape,dtype", [
    (presets.MXFP4, (40, 2050), torch.float32), (presets.NVFP4, (24, 4008), torch.float32),
    (presets.MXFP4, (24, 4008), torch.bfloat16), (presets.NVFP4, (40, 2050), torch.float16),
    (presets.BFP16, (20, 4001), torch.bfloat16),
], ids=str)
def test_observers_read_padded_rows_in_place(name, spec, shape, dtype, monkeypatch):
    """No padded copy of the input (old code: ``aten.constant_pad_nd`` and the units'
    reshape), the ranges written into the observer's own memory call after call, and the
    units path's state, qparams and non-finite check bit for bit, zero ties included."""
    kw = {"averaging_constant": 0.25} if name == "minmax" else {}
    xs = [ties(shape, dtype, seed) for seed in (1, 2, 3)]
    got, ptrs = quantscope.get_observer(name, spec, **kw), []
    for x in xs:
        with Copies(x) as copies:
            got(x)
        assert copies.found == [], f"copied by {copies.found}"
        ptrs.append(got.min_vals.data_ptr())
    if name == "memoryless_minmax":  # the state's memory, written in place after the first
        assert ptrs[1] == ptrs[2] == ptrs[0]
    assert_as_units_path(monkeypatch, got, name, spec, kw, xs)
    got(ties(shape, dtype, 4, (float("nan"),)))
    with pytest.raises(ValueError, match="NaN or inf"):
        got.calculate_qparams()


def test_the_kernel_refuses_what_it_cannot_cut():
    """-1 (the caller copies): a width the block divides (no padded block), a block longer
    than its buffer, no block or no row."""
    x, lo, hi = torch.zeros(4, 4100), torch.empty(12), torch.empty(12)
    call = lambda W, E, R=4: stats._kernel().qs_padded_minmax(
        x.data_ptr(), R, W, E, lo.data_ptr(), hi.data_ptr(), 1, 0)
    assert [call(4096, 2048), call(4100, 4096), call(4100, 0), call(4100, 2048, 0)] == [-1] * 4
    assert call(4100, 2048) == 0 and lo.tolist() == hi.tolist() == [0.0] * 12
