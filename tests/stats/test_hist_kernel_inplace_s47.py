"""Mutation round s47 on ``stats.hist_kernel``'s in-place rules, called directly: every tensor
the C writes must be one torch would let it write (not made under inference_mode, written
outside it), each of a regrid's state tensors tested, not only the counts; and every tensor
written has its version bumped, on the bf16 / fp16 piece path and for a fused pass's ends."""

import pytest
import torch

from quantscope.stats import hist_kernel
from quantscope.stats import histogram as H

pytestmark = pytest.mark.skipif(hist_kernel._kernel() is None, reason="no C kernel")


def _state(units=2, bins=16):
    st = H._update_grid(H.empty_state(units, bins), torch.tensor([-1.0, -2.0][:units]),
                        torch.tensor([1.0, 2.0][:units]), False)
    return H.HistState(*(t.clone() for t in st))


def test_bin_values_leaves_inference_counts_to_the_torch_path():
    st = _state()
    with torch.inference_mode():
        counts = st.counts.clone()
    before = counts.clone()
    units = torch.randn(2, 64)
    assert not hist_kernel.bin_values(counts, units, st.exp, st.first, False)
    assert torch.equal(counts, before), "the C kernel wrote an inference tensor"


@pytest.mark.parametrize("which", [1, 2, 3, 4], ids=["exp", "first", "lo", "hi"])
def test_regrid_in_place_tests_every_state_tensor(which):
    st = list(_state())
    with torch.inference_mode():
        st[which] = st[which].clone()
    before = [t.clone() for t in st]
    wider = (torch.tensor([-8.0, -8.0]), torch.tensor([8.0, 8.0]))
    assert hist_kernel.regrid(tuple(st), *wider, False, inplace=True) is None
    assert all(torch.equal(a, b) for a, b in zip(st, before)), "the C kernel wrote the state"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bin_values_of_half_units_bumps_the_counts_version(dtype):
    st = _state()
    v = st.counts._version
    assert hist_kernel.bin_values(st.counts, torch.randn(2, 64).to(dtype), st.exp, st.first,
                                  False)
    assert st.counts._version > v and int(st.counts.sum()) == 128


def test_fused_update_bumps_the_version_of_the_ends_it_writes():
    units = torch.tensor([[1.0, 5.0, -3.0] * 100])
    st = H._update_grid(H.empty_state(1, 64), torch.tensor([-3.0]), torch.tensor([5.0]), False)
    ends = torch.empty(2)
    v = ends._version
    assert hist_kernel.fused_update(st, units, False, ends=ends) is not None
    assert ends.tolist() == [-3.0, 5.0] and ends._version > v


def test_fused_update_leaves_inference_ends_to_the_torch_path():
    """Ends made under inference_mode, given outside it: torch would refuse the write, so the
    C pass misses and leaves them as they were (it does not write them through their
    pointer)."""
    units = torch.tensor([[1.0, 5.0, -3.0] * 100])
    st = H._update_grid(H.empty_state(1, 64), torch.tensor([-3.0]), torch.tensor([5.0]), False)
    with torch.inference_mode():
        ends = torch.full((2,), 7.0)
    assert hist_kernel.fused_update(st, units, False, ends=ends) is None
    assert ends.tolist() == [7.0, 7.0]
