"""Pins from a mutation round over ``quantscope.stats.minmax`` and ``stats.minmax_actorder``
(s66): behaviours that every existing test passed with changed, each checked against its
docstring or the op's schema on a few small values. The caller's ``out`` pair taken on the
strided and half torch paths and refused where a kernel could not write it, ``ends`` and a
state of another dtype, the torch path's ends taken before a moving-average update, the
non-finite helpers (``ordered``, ``holds_non_finite``, ``zero_non_finite``, ``record_ends``)
and unknown update kinds; the ops' argument checks, their inputs left unwritten and their
flags and token counts accumulated; ``op_units``' views; and ``actorder_minmax`` declining
what its docstring leaves to the caller (no ``g_idx``, other dtypes, autograd, one unit, no
kernel, rows that do not collapse)."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope.layout import Channel, Group, Tile
from quantscope.stats import minmax as MM
from quantscope.stats import minmax_actorder
from quantscope.stats.minmax_layouts import column_minmax

needs_kernel = pytest.mark.skipif(MM._kernel() is None, reason="no compiled kernel")
PATHS = [pytest.param("kernel", marks=needs_kernel), "torch"]


def _units(U=6, E=40, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(U, E, generator=g).to(dtype)


def _path(monkeypatch, path):
    if path == "torch":
        monkeypatch.setattr(MM, "_kernel", lambda: None)


# ---- unit_minmax: out, ends, update ------------------------------------------------------

@pytest.mark.parametrize("step", [False, True], ids=["plain", "step"])
def test_strided_units_are_reduced_into_the_callers_out_pair(step):
    """Strided CPU units (a transposed view: torch's amin / amax path, an observer's step
    too: the kernel reads rows of contiguous memory only) write their min / max into the
    caller's ``out`` pair and return it."""
    units = _units(40, 6).t()
    assert not units.is_contiguous()
    out, ends = (torch.zeros(6), torch.zeros(6)), torch.zeros(2)
    lo, hi = MM.unit_minmax(units, out, ends if step else None)
    assert lo is out[0] and hi is out[1]
    assert torch.equal(out[0], units.amin(1)) and torch.equal(out[1], units.amax(1))
    if step:
        assert ends.tolist() == [float(units.min()), float(units.max())]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_units_on_the_torch_path_fill_the_out_pair_in_order(monkeypatch, dtype):
    """Half units reduced by torch, widened into the caller's float32 ``out``: the min into
    ``out[0]``, the max into ``out[1]``."""
    monkeypatch.setattr(MM, "_kernel", lambda: None)
    units = _units(dtype=dtype)
    out = torch.zeros(6), torch.zeros(6)
    lo, hi = MM.unit_minmax(units, out)
    assert lo is out[0] and hi is out[1]
    assert torch.equal(lo, units.amin(1).float()) and torch.equal(hi, units.amax(1).float())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", ["hi-strided", "hi-float64", "hi-too-long"])
def test_an_out_pair_the_kernel_cannot_write_is_not_taken(monkeypatch, path, bad):
    """``out`` is taken only as two contiguous ``[U]`` tensors of the result dtype; another
    pair is left unwritten and the results come back in new tensors (a strided ``hi``
    written as contiguous memory would scatter the values into its storage's gaps)."""
    _path(monkeypatch, path)
    units = _units()
    storage = torch.zeros(12)
    hi = {"hi-strided": storage[::2], "hi-float64": torch.zeros(6, dtype=torch.float64),
          "hi-too-long": torch.zeros(7)}[bad]
    out = torch.zeros(6), hi
    lo_got, hi_got = MM.unit_minmax(units, out, torch.empty(2))  # ends: the kernel's step
    assert hi_got is not hi and hi_got.shape == (6,) and hi_got.dtype == torch.float32
    assert torch.equal(lo_got, units.amin(1)) and torch.equal(hi_got, units.amax(1))
    assert not storage.any() and not hi.any()


@pytest.mark.parametrize("step", [False, True], ids=["plain", "step"])
def test_units_that_require_grad_keep_their_autograd(step):
    """The C kernel's results carry no autograd: units that require grad (large, or an
    observer's small step) are reduced by torch, whose min / max keep their graph."""
    units = _units(64, 1024 if not step else 40).requires_grad_()
    lo, hi = MM.unit_minmax(units, None, torch.empty(2) if step else None)
    assert lo.requires_grad and hi.requires_grad
    assert torch.equal(lo.detach(), units.detach().amin(1))


def test_column_minmax_of_a_tensor_that_requires_grad_keeps_its_autograd():
    """``column_minmax`` (the layouts' kernel test ``_use_kernel``): a large ``m`` that
    requires grad goes to torch, whose column min / max keep their graph."""
    m = _units(256, 300).requires_grad_()
    lo, hi = column_minmax(m)
    assert lo.requires_grad and hi.requires_grad
    assert torch.equal(hi.detach(), m.detach().amax(0))


def test_units_without_elements_are_refused():
    with pytest.raises(ValueError, match="must have elements"):
        MM.unit_minmax(torch.empty(3, 0))


@pytest.mark.parametrize("path", PATHS)
def test_float64_ends_receive_the_smallest_min_and_largest_max(monkeypatch, path):
    """``ends`` of another dtype is not the kernel's float32 pair: it still receives the
    smallest min and the largest max (torch's copy)."""
    _path(monkeypatch, path)
    units = _units()
    ends = torch.zeros(2, dtype=torch.float64)
    MM.unit_minmax(units, None, ends)
    assert ends.tolist() == [float(units.min()), float(units.max())]


@pytest.mark.parametrize("path", PATHS)
def test_a_float64_state_gets_the_running_min_and_max(monkeypatch, path):
    """A state the kernel cannot write (float64) is still updated: by torch's ops."""
    _path(monkeypatch, path)
    units = _units()
    slo = torch.full((6,), math.inf, dtype=torch.float64)
    shi = torch.full((6,), -math.inf, dtype=torch.float64)
    MM.unit_minmax(units, None, torch.empty(2), ("min", 0.0, slo, shi))
    assert torch.equal(slo, units.amin(1).double()) and torch.equal(shi, units.amax(1).double())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["ema", "ema_lerp"])
def test_ends_are_the_batchs_not_the_averaged_states(monkeypatch, path, kind):
    """``ends`` is the batch's smallest min and largest max (the non-finite check reads the
    batch), not taken from the per-unit pair a moving-average update overwrote."""
    _path(monkeypatch, path)
    units = _units()
    slo, shi = torch.full((6,), -100.0), torch.full((6,), 100.0)
    ends = torch.zeros(2)
    MM.unit_minmax(units, None, ends, (kind, 0.5, slo, shi))
    assert ends.tolist() == [float(units.min()), float(units.max())]


# ---- update_state, ema_, ordered -------------------------------------------------------------

def test_an_unknown_update_kind_is_refused():
    s, b = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="unknown kind 'mean'"):
        MM.update_state("mean", 0.5, s, s.clone(), b, b.clone())
    with pytest.raises(ValueError, match="unknown kind 'min'"):
        MM.ema_("min", 0.5, s, b)


def test_ordered_puts_crossed_ends_in_order():
    """Ends crossed by the EMA's rounding come back as (the smaller, the larger) per unit."""
    lo, hi = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 4.0, 3.0])
    a, b = MM.ordered(lo, hi)
    assert a.tolist() == [0.5, -2.0, 3.0] and b.tolist() == [1.0, 4.0, 3.0]


# ---- the non-finite helpers --------------------------------------------------------------

def test_holds_non_finite_reads_an_empty_tensor_as_finite():
    assert MM.holds_non_finite(torch.empty(0)) is False


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_holds_non_finite_finds_each_non_finite_value(bad):
    """NaN, +inf and -inf each: the min and the max both are read."""
    x = torch.randn(50)
    assert MM.holds_non_finite(x) is False
    x[17] = bad
    assert MM.holds_non_finite(x) is True


def test_zero_non_finite_zeroes_nan_and_both_infinities_and_counts_them():
    x = torch.tensor([1.0, math.nan, math.inf, -2.0, -math.inf, math.nan])
    zeroed, count = MM.zero_non_finite(x)
    assert zeroed.tolist() == [1.0, 0.0, 0.0, -2.0, 0.0, 0.0]
    assert count.dim() == 0 and int(count) == 4


@pytest.mark.parametrize("ends", [[-math.inf, 1.0], [0.0, math.inf], [math.nan, 2.0]])
def test_record_ends_sets_seen_where_either_end_is_not_finite(ends):
    seen = torch.tensor(False)
    MM.record_ends(torch.tensor(ends), seen)
    assert bool(seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_record_ends_keeps_an_earlier_flag(dtype):
    """``seen |=``: finite ends leave a flag set by an earlier batch set (float64 ends: the
    tensor path, no host read), and non-finite ones set it."""
    seen = torch.tensor(True)
    MM.record_ends(torch.tensor([-1.0, 1.0], dtype=dtype), seen)
    assert bool(seen)
    seen = torch.tensor(False)
    MM.record_ends(torch.tensor([-1.0, 1.0], dtype=dtype), seen)
    assert not bool(seen)
    MM.record_ends(torch.tensor([-1.0, math.inf], dtype=dtype), seen)
    assert bool(seen)


# ---- the ops: minmax_update, record_non_finite, minmax_observe ---------------------------

def test_minmax_update_leaves_its_inputs_as_they_are():
    """The op's schema writes only ``state_lo`` / ``state_hi``: a moving average's batch
    ``lo`` / ``hi`` are not overwritten (``update_state`` itself may)."""
    lo, hi = torch.tensor([-1.0, -3.0]), torch.tensor([2.0, 5.0])
    slo, shi = torch.zeros(2), torch.zeros(2)
    MM.minmax_update(lo, hi, slo, shi, MM.UPDATES["ema"], 0.5)
    assert lo.tolist() == [-1.0, -3.0] and hi.tolist() == [2.0, 5.0]
    assert slo.tolist() == [-0.5, -1.5] and shi.tolist() == [1.0, 2.5]


@pytest.mark.parametrize("bad", ["lo-2d", "hi-float64", "state-strided"])
def test_minmax_update_refuses_bad_tensors(bad):
    lo, hi = torch.zeros(4), torch.ones(4)
    slo, shi = torch.zeros(4), torch.zeros(4)
    if bad == "lo-2d":
        lo, hi = torch.zeros(4, 1), torch.ones(4, 1)
        slo, shi = torch.zeros(4, 1), torch.zeros(4, 1)
    elif bad == "hi-float64":
        hi = hi.double()
    else:
        slo = torch.zeros(8)[::2]
    with pytest.raises(ValueError, match="minmax_update"):
        MM.minmax_update(lo, hi, slo, shi, MM.UPDATES["min"], 0.0)


def test_record_non_finite_accumulates_the_flag():
    """``seen`` is or-ed: finite ranges after a non-finite one leave it set."""
    seen = torch.zeros((), dtype=torch.bool)
    MM.record_non_finite(torch.tensor([-1.0, math.nan]), torch.tensor([1.0, 2.0]), seen)
    assert bool(seen)
    MM.record_non_finite(torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 2.0]), seen)
    assert bool(seen)


def test_record_non_finite_of_no_units_records_nothing():
    seen = torch.zeros((), dtype=torch.bool)
    MM.record_non_finite(torch.empty(0), torch.empty(0), seen)
    assert not bool(seen)


def test_record_non_finite_refuses_a_seen_that_is_no_bool():
    with pytest.raises(ValueError, match="seen must be one bool"):
        MM.record_non_finite(torch.zeros(2), torch.ones(2), torch.zeros(()))


def _observe_state(n):
    return (torch.full((n,), math.inf), torch.full((n,), -math.inf),
            torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.int64))


def test_minmax_observe_adds_each_calls_count_to_the_tokens():
    """``count`` tokens are added to ``tokens``; the state is the running min / max."""
    a, b = _units(seed=1), _units(seed=2)
    slo, shi, seen, tokens = _observe_state(6)
    MM.minmax_observe(a, slo, shi, seen, tokens, MM.UPDATES["min"], 0.0, 5)
    MM.minmax_observe(b, slo, shi, seen, tokens, MM.UPDATES["min"], 0.0, 7)
    assert int(tokens) == 12 and not bool(seen)
    assert torch.equal(slo, torch.minimum(a.amin(1), b.amin(1)))
    assert torch.equal(shi, torch.maximum(a.amax(1), b.amax(1)))


@pytest.mark.parametrize("bad", ["no-elements", "state-strided"])
def test_minmax_observe_refuses_bad_units_and_state(bad):
    """A 4-D view ``[U1, U2, E1, E2]`` with no elements (``E1 = 0``), and a strided state:
    refused by the op's own check, before any of its parts runs."""
    if bad == "no-elements":
        units, n = torch.empty(2, 3, 0, 5), 6
        slo, shi, seen, tokens = _observe_state(n)
        match = "units must be"
    else:
        units, n = _units(), 6
        _, shi, seen, tokens = _observe_state(n)
        slo, match = torch.zeros(12)[::2], "minmax_observe: state_lo must be"
    with pytest.raises(ValueError, match=match):
        MM.minmax_observe(units, slo, shi, seen, tokens, MM.UPDATES["min"], 0.0, 1)


# ---- op_units, op_unit_count ---------------------------------------------------------------

def test_op_units_declines_autograd_and_empty_inputs():
    """None where the op cannot read the units: a tensor that requires grad, no units."""
    assert MM.op_units(torch.randn(4, 16, requires_grad=True), Group(16)) is None
    assert MM.op_units(torch.empty(0, 16), Group(16)) is None


def test_op_units_of_a_first_axis_channel_are_rows():
    """Channel 0 units are rows of ``x`` already: ``[U, E]``, not the 4-D view."""
    x = torch.randn(8, 3, 5)
    units = MM.op_units(x, Channel(0))
    assert units.shape == (8, 15) and torch.equal(units, x.reshape(8, 15))


def test_op_units_of_padded_tiles_are_the_layouts_units():
    """Tiles that do not divide both of the last two dims (padding) are ``to_units``' rows;
    a 4-D tile view takes only tiles that divide both."""
    x = torch.randn(16, 20)
    layout = Tile(8, 16)
    units = MM.op_units(x, layout)
    assert units.dim() == 2 and torch.equal(units, layout.to_units(x))


def test_op_unit_count_of_a_4d_view_counts_both_unit_dims():
    assert MM.op_unit_count(torch.empty(2, 3, 4, 5)) == 6
    assert MM.op_unit_count(torch.empty(7, 4)) == 7


# ---- actorder_minmax: what it declines ---------------------------------------------------

def _act_order(columns, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Group(size, g_idx=torch.randperm(columns, generator=g) % (columns // size))


@needs_kernel
def test_actorder_minmax_reads_its_units_in_the_layouts_order():
    """Float32 / fp16: every unit's min / max of ``to_units``' permuted copy, float32."""
    layout = _act_order(32, 8)
    for dtype in (torch.float32, torch.float16):
        x = _units(4, 32, dtype=dtype)
        lo, hi = minmax_actorder.actorder_minmax(x, layout)
        units = layout.to_units(x)
        assert lo.dtype == torch.float32 and lo.shape == (16,)
        assert torch.equal(lo, units.amin(1).float()) and torch.equal(hi, units.amax(1).float())


@pytest.mark.parametrize("case", ["no-g_idx", "float64", "requires-grad", "one-unit",
                                  "no-kernel", "rows-apart"])
def test_actorder_minmax_leaves_to_the_caller_what_it_does_not_read(monkeypatch, case):
    """None (the caller builds the units) for a plain ``Group``, a dtype the kernel does not
    read, autograd, a single unit, no compiled kernel, rows that are no one stride apart."""
    layout, x = _act_order(32, 8), _units(4, 32)
    if case == "no-g_idx":
        layout = Group(8)
    elif case == "float64":
        x = x.double()
    elif case == "requires-grad":
        x.requires_grad_()
    elif case == "one-unit":
        layout, x = _act_order(8, 8), _units(1, 8)
    elif case == "no-kernel":
        monkeypatch.setattr(minmax_actorder, "_kernel", lambda: None)
    else:
        x = torch.randn(4, 6, 32)[:, :3]
    assert minmax_actorder.actorder_minmax(x, layout) is None


@needs_kernel
def test_actorder_minmax_reads_groups_along_the_first_axis():
    """Groups along axis 0 of a 3-D tensor: ``to_units``' units, not the last axis'."""
    g = torch.Generator().manual_seed(3)
    layout = Group(4, 0, g_idx=torch.randperm(8, generator=g) % 2)
    x = _units(8, 15).reshape(8, 3, 5)
    lo, hi = minmax_actorder.actorder_minmax(x, layout)
    units = layout.to_units(x)
    assert torch.equal(lo, units.amin(1)) and torch.equal(hi, units.amax(1))
