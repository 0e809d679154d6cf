"""Activation-order groups (``Group(size, g_idx=...)``) in the min-max family on the CPU: their
per-unit min / max are read from the tensor where it lies (``stats.minmax_actorder``, the C
``qs_actorder_minmax``), where ``layout.to_units`` had permuted a copy of the whole tensor
first (13-23x a plain ``Group``'s time on a 4096 x 4096 weight, found by probing). Every
result must be the copy path's bit for bit, NaN and the sign of a zero min / max included,
and equal torch's min / max of the permuted columns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_names import Copies, OpNames

import quantscope
from quantscope import Group, QuantSpec
from quantscope.observers import base
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FAMILIES = {"memoryless_minmax": {}, "static_minmax": {}, "minmax": {"averaging_constant": 0.25}}

pytestmark = pytest.mark.skipif(stats._kernel() is None, reason="no compiled kernel")


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s float32 bit patterns, every NaN as one (the kernel writes its own NaN)."""
    t = t.float()
    return torch.where(t.isnan(), 7.0, t).view(torch.int32)


def act_order(columns: int, size: int, seed: int = 0, axis: int = -1) -> Group:
    """A random activation order: each of the ``columns // size`` groups gets ``size``
    columns anywhere (a permutation's positions, as GPTQ's ``g_idx``)."""
    g = torch.Generator().manual_seed(seed)
    return Group(size, axis, g_idx=torch.randperm(columns, generator=g) % (columns // size))


def values(shape, dtype=torch.float32, seed=0, zeros=0.0, specials=()) -> torch.Tensor:
    """Random values of ``shape``, a fraction ``zeros`` of them -0.0 or +0.0 (whose ties
    come back by the order the values meet), ``specials`` (NaN, +-inf) at a few places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[torch.rand(shape, generator=g) < zeros] = 0.0
    x *= torch.randint(0, 2, shape, generator=g) * 2 - 1.0  # the zeros' signs too
    for i, v in enumerate(specials):
        x.view(-1)[(i * 7919 + seed) % x.numel()] = v
    return x.to(dtype)


def copy_path(x: torch.Tensor, layout: Group):
    """The path before: the row kernel on ``to_units``' permuted copy (``ends``: the
    kernel whatever the size, as an observer's step)."""
    return stats.unit_minmax(layout.to_units(x), ends=torch.empty(2))


def torch_minmax(x: torch.Tensor, layout: Group):
    """From first principles: the columns along the layout's axis in the stable order of
    ``g_idx``, each run of ``size`` a group, torch's min / max of each."""
    m = x.movedim(layout.axis, -1)
    perm = torch.argsort(layout.g_idx, stable=True)
    units = m.reshape(-1, m.shape[-1])[:, perm].reshape(-1, layout.size)
    return units.amin(1).float(), units.amax(1).float()


def assert_same(got, x, layout):
    """Bitwise the copy path's; torch's values (a zero's sign aside), NaN where it has."""
    for a, b, c in zip(got, copy_path(x, layout), torch_minmax(x, layout)):
        assert a.dtype == torch.float32 and a.shape == b.shape == c.shape
        assert torch.equal(bits(a), bits(b))
        assert torch.equal(a.isnan(), c.isnan()) and torch.equal(a.nan_to_num(7.0),
                                                                 c.nan_to_num(7.0))


@st.composite
def cases(draw):
    """A tensor (contiguous or a view: transposed, a column slice, every other row, columns
    two apart, three dims, the groups along axis 0) and an activation order that fits it."""
    size = draw(st.sampled_from([1, 2, 3, 5, 8, 12, 16, 24, 32, 40, 64, 128]))
    C = size * draw(st.integers(1, 6))
    R = draw(st.integers(1, 40))
    view = draw(st.sampled_from(["contiguous", "transposed", "slice", "rows", "columns",
                                 "3-d", "axis 0"]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 999))
    zeros = draw(st.sampled_from([0.0, 0.3, 1.0]))
    specials = draw(st.sampled_from([(), (float("nan"),), (float("inf"), -float("inf"))]))
    shape = {"transposed": (C, R), "slice": (R, C + 5), "rows": (2 * R, C),
             "columns": (R, 2 * C), "3-d": (2, R, C), "axis 0": (C, R)}.get(view, (R, C))
    x = values(shape, dtype, seed, zeros, specials)
    x = {"transposed": lambda: x.t(), "slice": lambda: x[:, :C], "rows": lambda: x[::2],
         "columns": lambda: x[:, ::2]}.get(view, lambda: x)()
    return x, act_order(C, size, seed, 0 if view == "axis 0" else -1)


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from([1, 3]))
def test_act_order_groups_read_in_place_equal_the_permuted_copy(case, threads):
    """Every unit as the copy path gave it, split over threads as it split the copy (its
    share of units decides which units the row kernel reduces together)."""
    x, layout = case
    old = stats.THREAD_MIN_NUMEL, torch.get_num_threads()
    stats.THREAD_MIN_NUMEL = 1
    torch.set_num_threads(threads)
    try:
        got = minmax_layouts.layout_minmax(x, layout)
        if got is None:  # one unit only: its copy is the whole tensor, reduced at once
            assert layout.num_units(x.shape) == 1
            return
        assert_same(got, x, layout)
    finally:
        stats.THREAD_MIN_NUMEL = old[0]
        torch.set_num_threads(old[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [8, 64, 67])
def test_zero_ends_and_nan_blocks_take_the_row_kernels_order(dtype, rows):
    """Units whose min or max is a zero of either sign (pruned rows, all-zero groups), and
    blocks of rows that hold NaN: the fast pass meets their values in another order, so
    they are reduced again as the copy was (the sign it gave each zero)."""
    x = values((rows, 256), dtype, seed=rows, zeros=0.9, specials=(float("nan"),))
    x[3] = 0.0
    x[5] = -0.0
    x[6, ::2] = -0.0  # a row of zeros of both signs
    layout = act_order(256, 16, seed=rows)
    got = minmax_layouts.layout_minmax(x, layout)
    assert got is not None and (got[0] == 0).any() and got[0].isnan().any()
    assert_same(got, x, layout)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("rows", [7, 16])
@pytest.mark.parametrize("size", [24, 40, 48])
def test_zero_units_are_reduced_in_the_row_kernels_runs(size, rows, threads, monkeypatch):
    """All-zero units of both signs, whose zero's sign follows the order the row kernel
    reduces them in: float32 units of up to 64 in runs of 4 from the start of each thread's
    share (2048 // size units a piece would cut those runs), as the copy path reduced them."""
    monkeypatch.setattr(stats, "THREAD_MIN_NUMEL", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(3):
            x = values((rows, 40 * size), seed=seed, zeros=1.0)
            layout = act_order(40 * size, size, seed)
            assert_same(minmax_layouts.layout_minmax(x, layout), x, layout)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shape,size", [((16, 384), 384), ((16, 12), 12), ((1, 4096), 4096)])
def test_a_single_group(shape, size):
    """All columns one group (``g_idx`` all zeros): in place from two units on; one unit (a
    single row) is a whole-tensor reduction, left to the copy path."""
    layout = Group(size, g_idx=torch.zeros(shape[1], dtype=torch.int32))
    x = values(shape, seed=size, zeros=0.5)
    got = minmax_layouts.layout_minmax(x, layout)
    if shape[0] == 1:
        assert got is None
        return
    assert_same(got, x, layout)


def test_a_g_idx_leaving_a_group_empty_never_reaches_the_kernel():
    """Every group must hold ``size`` columns: the layout refuses one left empty (the
    kernel's units are the stable order's runs of ``size``)."""
    with pytest.raises(ValueError, match="exactly size=2 columns in each group"):
        Group(2, g_idx=torch.tensor([0, 0, 0, 1]))
    with pytest.raises(ValueError, match="got group index 2"):
        Group(2, g_idx=torch.tensor([0, 0, 2, 2]))


def test_views_that_are_no_matrix_and_other_inputs_take_the_copy_path():
    layout = act_order(64, 16)
    x = values((4, 6, 64))[:, :3]  # leading dims that no one stride spans
    assert minmax_layouts.layout_minmax(x, layout) is None
    assert minmax_layouts.layout_minmax(values((8, 64)).double(), layout) is None
    assert minmax_layouts.layout_minmax(values((8, 64)).requires_grad_(), layout) is None


CASES = [((256, 512), 128), ((512, 384), 32), ((384, 320), 40)]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,size", CASES)
def test_observers_read_act_order_groups_in_place(shape, size, dtype, name, monkeypatch):
    """No op makes a tensor of the input's size (``to_units`` had: ``index_select``), and
    the state, the non-finite flag and the token count are the copy path's (the observer
    with the direct path turned off), over two calls."""
    spec = QuantSpec("int4", act_order(shape[1], size, seed=size))
    got = quantscope.get_observer(name, spec, **FAMILIES[name])
    want = quantscope.get_observer(name, spec, **FAMILIES[name])
    batches = [values(shape, dtype, seed=s, zeros=0.2) for s in (1, 2)]
    batches[1][7, 3] = float("inf")
    for x in batches:
        with Copies(x) as copies, OpNames() as ops:
            got(x)
        assert copies.found == [] and "aten.index_select" not in ops.names, copies.found
        with monkeypatch.context() as m:
            m.setattr(base, "layout_minmax", lambda *args: None)
            want(x)
    for a, b in ((got.min_vals, want.min_vals), (got.max_vals, want.max_vals)):
        assert torch.equal(bits(a), bits(b))
    assert bool(got.seen_non_finite) and bool(want.seen_non_finite)
    assert int(got.observed_tokens) == int(want.observed_tokens)


def test_a_transposed_act_order_weight_is_read_in_place(monkeypatch):
    """A weight stored transposed (``w.t()``, as GPT-OSS's experts): each column's rows are
    adjacent in memory, read as they lie; the qparams are the copy path's."""
    spec = QuantSpec("int4", act_order(512, 128, seed=3))
    x = values((512, 256), seed=3, zeros=0.1).t()
    got, want = (quantscope.get_observer("memoryless_minmax", spec) for _ in range(2))
    with Copies(x) as copies:
        got(x)
    assert copies.found == []
    monkeypatch.setattr(base, "layout_minmax", lambda *args: None)
    want(x)
    assert torch.equal(bits(got.min_vals), bits(want.min_vals))
    assert torch.equal(bits(got.max_vals), bits(want.max_vals))
    assert torch.equal(got.calculate_qparams().scale, want.calculate_qparams().scale)
