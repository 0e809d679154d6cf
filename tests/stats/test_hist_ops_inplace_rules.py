"""The histogram ops' C writes follow torch's in-place rules: a state made under
torch.inference_mode is refused outside it (torch's own error, as hist_add's torch path
gives), and every tensor written has its version bumped."""

import pytest
import torch

from quantscope.stats import histogram as H
from quantscope.stats.hist_ops import hist_add, hist_regrid_

WIDER = (torch.tensor([-8.0, -8.0]), torch.tensor([8.0, 8.0]))  # moves every unit's grid


def _state():
    st = H._update_grid(H.empty_state(2, 16), torch.tensor([-1.0, -2.0]),
                        torch.tensor([1.0, 2.0]), False)
    return H.HistState(*(t.clone() for t in st))


def test_regrid_refuses_an_inference_state_outside_inference_mode():
    with torch.inference_mode():
        st = _state()
    before = [t.clone() for t in st]
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        hist_regrid_(*st, *WIDER, False)
    assert all(torch.equal(a, b) for a, b in zip(st, before)), "the C kernel wrote it"


def test_regrid_and_add_bump_the_versions_of_what_they_write():
    st = _state()
    v0 = [t._version for t in st]
    hist_regrid_(*st, *WIDER, False)
    assert all(t._version > v for t, v in zip(st, v0))
    v = st.counts._version
    hist_add(st.counts, torch.randn(2, 50), st.exp, st.first, False)
    assert st.counts._version > v


def test_ops_still_run_inside_inference_mode():
    with torch.inference_mode():
        st = _state()
        hist_regrid_(*st, *WIDER, False)
        hist_add(st.counts, torch.randn(2, 50), st.exp, st.first, False)
    assert int(st.counts.sum()) == 100


def test_fused_update_writes_the_ends_it_returns_for():
    """Given ends it may not write (an inference tensor outside inference mode), the fused
    C pass misses (the caller's torch path writes them) rather than returning a result with
    the caller's ends unwritten."""
    from quantscope.stats import hist_kernel
    if hist_kernel._kernel() is None:
        pytest.skip("no C kernel")
    units = torch.tensor([[1.0, 5.0, -3.0] * 100])
    st = H._update_grid(H.empty_state(1, 64), torch.tensor([-3.0]), torch.tensor([5.0]), False)
    ends = torch.empty(2)
    assert hist_kernel.fused_update(st, units, False, ends=ends) is not None
    assert ends.tolist() == [-3.0, 5.0]
    with torch.inference_mode():
        ends = torch.full((2,), 7.0)
    got = hist_kernel.fused_update(st, units, False, ends=ends)
    assert got is None or ends.tolist() == [-3.0, 5.0]
