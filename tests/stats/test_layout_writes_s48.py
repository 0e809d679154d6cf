"""How the in-place layout paths write an observer's reused memory (``out_for``), s48 review:

* the column kernel's writes bump the version counter, as ``unit_minmax``'s and the act-order
  pass's do (an in-place torch op would): a tensor saved for backward and then overwritten
  was used silently;
* runs of a permuted input whose units come in another order than ``x``'s are put back into
  fresh memory: the caller's pair had been overwritten in the memory's order, so a reference
  to the observer's earlier state read a scrambled range.
"""

from __future__ import annotations

import pytest
import torch

from quantscope import Block, Group, QuantSpec
from quantscope.observers.registry import get_observer


def _weight():
    return torch.randn(512, 384, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("spec", [QuantSpec("fp4_e2m1", Block(16)), QuantSpec("int4", "group:32")],
                         ids=["block16", "group32"])
def test_column_kernel_writes_bump_the_version(spec):
    obs = get_observer("memoryless_minmax", spec)
    w = _weight()
    obs(w.t() * 3)
    lo = obs.min_vals
    scale = torch.ones_like(lo, requires_grad=True)
    y = (scale * lo).sum()  # saves lo for scale's gradient
    version = lo._version
    obs(w.t())  # the bands path writes lo's memory again
    assert obs.min_vals.data_ptr() == lo.data_ptr()  # written in place: out_for's point
    assert lo._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_permuted_runs_leave_the_callers_memory_in_its_order():
    y = torch.randn(64, 32, 48, generator=torch.Generator().manual_seed(1))
    x = y.permute(1, 2, 0)  # runs along x's axis 0, not its memory's last
    layout = Group(16, 0)
    obs = get_observer("memoryless_minmax", QuantSpec(layout=layout))
    obs(x * 2)
    held, before = obs.min_vals, obs.min_vals.clone()
    obs(x)
    assert torch.equal(obs.min_vals, layout.to_units(x).amin(1))
    # the earlier state is either left as it was, or holds the new range in x's order
    assert torch.equal(held, before) or torch.equal(held, obs.min_vals)
