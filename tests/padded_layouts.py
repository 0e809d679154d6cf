"""Helpers of the in-place layout tests (ragged tiles, padded blocks): bit patterns, the
copy path's per-unit ranges, and test tensors without zeros."""

from __future__ import annotations

import torch

import quantscope
from quantscope.observers import base
from quantscope.stats import minmax as stats
from quantscope.stats import minmax_layouts


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s float32 bit patterns, NaN as one value (the kernel returns its own NaN)."""
    return t.float().nan_to_num(7.0).view(torch.int32)


def copy_path(x, layout):
    """Per-unit ``(lo, hi)`` from the padded units ``to_units`` builds, the padding then
    taken out (``unpad_minmax_``), as forward does without the in-place path."""
    units = layout.to_units(x)
    lo, hi = (t.float() for t in stats.torch_unit_minmax(units))
    minmax_layouts.unpad_minmax_(layout, units, x.shape, lo, hi)
    return lo, hi


def kernel_copy_path(x, layout):
    """:func:`copy_path` as the observers' units path reduces the padded copy: the row kernel
    (``unit_minmax`` with the ends, as forward asks; :func:`copy_path`'s torch reduction
    can give the other zero where -0.0 and +0.0 tie), then ``unpad_minmax_``."""
    units = layout.to_units(x)
    lo, hi = stats.unit_minmax(units, ends=torch.empty(2))
    minmax_layouts.unpad_minmax_(layout, units, x.shape, lo, hi)
    return lo, hi


def ties(shape, dtype, seed, bad=()):
    """Mostly -0.0 and +0.0 (a zero min / max, whose sign the order the values meet in
    decides), some +-1 and -2 (a block or tail of one sign at times), ``bad`` at a few
    places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(shape).masked_fill_(torch.rand(shape, generator=g) < 0.5, -0.0)
    p = torch.rand(shape, generator=g)
    x[p < 0.03] = 1.0
    x[p > 0.98] = -2.0
    x[(p > 0.5) & (p < 0.51)] = -1.0
    for i, v in enumerate(bad):
        x.view(-1)[(i * 7919 + seed) % x.numel()] = v
    return x.to(dtype)


def tensor(shape, dtype, seed, bad=()):
    """No zeros (a -0.0 / +0.0 tie may come back either way), all of one sign at times (a
    padded unit's min is its values', never the padding's 0), ``bad`` at a few places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g).add_(0.5)
    if seed % 3:
        x *= torch.randint(0, 2, shape, generator=g) * 2 - 1.0
    for i, v in enumerate(bad):
        x.view(-1)[(i * 7919) % x.numel()] = v
    return x.to(dtype)


def assert_as_units_path(monkeypatch, got, name, spec, kw, xs):
    """``got`` (observer ``name`` fed ``xs``) holds the units path's state bit for bit: the
    same observer fed ``xs`` with ``layout_minmax`` turned off; its scales equal too."""
    monkeypatch.setattr(base, "layout_minmax", lambda *args: None)
    want = quantscope.get_observer(name, spec, **kw)
    for x in xs:
        want(x)
    assert torch.equal(bits(got.min_vals), bits(want.min_vals))
    assert torch.equal(bits(got.max_vals), bits(want.max_vals))
    qg, qw = got.calculate_qparams(), want.calculate_qparams()
    assert torch.equal(qg.scale, qw.scale) and torch.equal(qg.zero_point, qw.zero_point)
