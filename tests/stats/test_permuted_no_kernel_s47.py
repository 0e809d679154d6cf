"""Permuted inputs (``w.t()``) where the C min / max kernel cannot run.

The in-place path for dense permuted inputs (``stats.minmax_layouts._permuted_minmax``)
called the column kernel without asking whether a library was there: with no compiler,
``QUANTSCOPE_NO_KERNEL=1``, or under ``torch.export`` / ``torch.compile`` (no data pointers),
groups and blocks of a transposed weight raised. Without the library the units path reads
them, as it did before the in-place path.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from quantscope import Block, Group, QuantSpec, get_observer
from quantscope.presets import MXFP4, NVFP4
from quantscope.stats import minmax_layouts

SPECS = [QuantSpec("int4", Group(32)), QuantSpec("int8", Block(16, axis=0)),
         QuantSpec("int8", "channel:1"), QuantSpec("int8"), MXFP4, NVFP4]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("name", ["memoryless_minmax", "static_minmax"])
def test_permuted_without_library_reads_the_units(monkeypatch, spec, name):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).t()
    want = get_observer(name, spec)
    want(w.contiguous())
    monkeypatch.setattr(minmax_layouts, "_kernel", lambda: None)
    assert minmax_layouts.layout_minmax(w, spec.layout) is None
    got = get_observer(name, spec)
    got(w)
    assert torch.equal(got.min_vals, want.min_vals) and torch.equal(got.max_vals, want.max_vals)


def test_export_observes_a_transposed_weight_by_groups():
    class Watch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.obs = get_observer("static_minmax", QuantSpec("int4", Group(32)))

        def forward(self, w):
            self.obs(w.t())
            return w * 2

    m, w = Watch(), torch.randn(512, 256, generator=torch.Generator().manual_seed(1))
    m(w)  # sizes the state eagerly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(m, (w,), strict=False)
    ref = get_observer("static_minmax", QuantSpec("int4", Group(32)))
    ref(w.t().contiguous())
    assert torch.equal(ep.module()(w), w * 2)
    assert torch.equal(m.obs.max_vals, ref.max_vals)
