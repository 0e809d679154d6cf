"""``stats.hist_kernel.fused_update``'s ``ends`` (s48 mutation round): ends the C pass cannot
write as its two floats (another shape) make it miss, the caller's tensor left as it was, as
ends it may not write do (test_hist_kernel_inplace_s47)."""

from __future__ import annotations

import pytest
import torch

from quantscope.stats import hist_kernel
from quantscope.stats import histogram as H

pytestmark = pytest.mark.skipif(hist_kernel._kernel() is None, reason="no compiled kernel")


@pytest.mark.parametrize("shape", [(3,), (1,), (2, 1), (1, 2), ()], ids=str)
def test_fused_update_misses_on_ends_of_another_shape(shape):
    units = torch.tensor([[1.0, 5.0, -3.0] * 100])
    st = H._update_grid(H.empty_state(1, 64), torch.tensor([-3.0]), torch.tensor([5.0]), False)
    ends = torch.full(shape, 7.0)
    v = ends._version
    assert hist_kernel.fused_update(st, units, False, ends=ends) is None
    assert bool((ends == 7.0).all()) and ends._version == v
    assert hist_kernel.fused_update(st, units, False, ends=torch.empty(2)) is not None  # (2,)


def test_fused_update_misses_on_a_batch_of_several_units():
    """The fused pass reads one unit (``units [1, E]``): a ``[2, E]`` batch with a one-unit
    state is no call it makes (None, nothing written), not a pass over its first row."""
    st = H._update_grid(H.empty_state(1, 64), torch.tensor([-3.0]), torch.tensor([5.0]), False)
    units = torch.tensor([[1.0, 5.0, -3.0] * 100, [9.0, -9.0, 0.5] * 100])
    ends = torch.full((2,), 7.0)
    assert hist_kernel.fused_update(st, units, False, ends=ends) is None
    assert ends.tolist() == [7.0, 7.0]
    assert hist_kernel.fused_update(st, units[:1], False, ends=ends) is not None
