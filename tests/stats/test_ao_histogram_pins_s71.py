"""stats.hist_ops and stats.ao_histogram where s71's mutants changed behaviour no test saw (the
file came from a mutation round): ``quantscope::hist_add``'s refusal of operands on another
device, ``quantscope::hist_regrid_``'s refusal of each bad state or batch argument by name
(the real op and the fake), an ``out`` of another size refused by ``histc`` and not taken by
``fused``, torch.ao's re-binning with ``upsample_rate`` 0, and a bfloat16 state's one-value and
re-binned histograms computed in bfloat16 as torch.ao's. Values and errors from the docstrings
and torch.ao."""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import HistogramObserver as TorchHistogramObserver

from quantscope import kernels
from quantscope.compat.torch_ao import HistogramObserver
from quantscope.stats import ao_histogram as A
from quantscope.stats import hist_ops
from quantscope.stats import histogram as H

needs_ao_kernel = pytest.mark.skipif(not kernels.available("ao_hist"), reason="no C kernel")
DEVICES = ["cpu", "meta"]  # meta: the fake implementation


# ---- quantscope::hist_add / hist_regrid_ argument checks ------------------------------------

@pytest.mark.parametrize("name", ["units", "exp", "first"])
def test_hist_add_refuses_an_operand_on_another_device_by_name(name):
    """``units``, ``exp`` and ``first`` must be on ``counts``' device (here meta vs CPU)."""
    args = {"counts": torch.zeros(2, 16, dtype=torch.int64), "units": torch.randn(2, 5),
            "exp": torch.zeros(2, dtype=torch.int64), "first": torch.zeros(2, dtype=torch.int64)}
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"quantscope::hist_add: {name} must be .* on cpu"):
        hist_ops.hist_add(args["counts"], args["units"], args["exp"], args["first"], False)


def _regrid_args(device):
    st = H.empty_state(2, 16, device=device)
    return {"counts": st.counts, "exp": st.exp, "first": st.first, "lo": st.lo, "hi": st.hi,
            "batch_lo": torch.full((2,), -1.0, device=device),
            "batch_hi": torch.full((2,), 1.0, device=device)}


#: (argument, a bad dtype or size for it): each check of ``_check_regrid`` in turn
_BAD_REGRID = [pytest.param("exp", torch.int32, 2, id="exp-int32"),
               pytest.param("first", torch.int64, 3, id="first-size3"),
               pytest.param("lo", torch.float64, 2, id="lo-float64"),
               pytest.param("hi", torch.float64, 2, id="hi-float64"),
               pytest.param("batch_lo", torch.float32, 1, id="batch_lo-size1"),
               pytest.param("batch_hi", torch.float64, 2, id="batch_hi-float64")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "dtype", "size"), _BAD_REGRID)
def test_hist_regrid_refuses_each_bad_argument_by_name(device, name, dtype, size):
    """Each of the state's ``exp``, ``first`` (int64 ``[U]``), ``lo``, ``hi`` and the batch's
    ``batch_lo``, ``batch_hi`` (float32 ``[U]``) of another dtype or shape: a ``ValueError``
    naming it, nothing written."""
    args = _regrid_args(device)
    args[name] = torch.zeros(size, dtype=dtype, device=device)
    before = {k: v.clone() for k, v in args.items()}
    with pytest.raises(ValueError, match=rf"quantscope::hist_regrid_: {name} must be"):
        hist_ops.hist_regrid_(*args.values(), False)
    if device == "cpu":
        assert all(torch.equal(args[k], before[k]) for k in args)


# ---- histc / fused: an out of another size ---------------------------------------------------

def test_histc_refuses_an_out_of_another_size():
    """``out`` must hold ``bins`` values: one of another size is no kernel input (it would be
    part-written); the torch path's ``view`` refuses it."""
    with pytest.raises(RuntimeError, match="shape"):
        A.histc(torch.randn(100), 4, -1.0, 1.0, out=torch.zeros(5))


@needs_ao_kernel
@pytest.mark.parametrize("out", [torch.zeros(5), torch.zeros(4, dtype=torch.float64)],
                         ids=["size5", "float64"])
def test_fused_does_not_apply_to_an_out_it_cannot_write(out):
    """``fused`` writes a float32 ``out`` of ``bins`` values; another is None, out untouched."""
    x = torch.rand(100)
    assert A.fused(x, 4, 0.0, 1.0, torch.zeros(4), out=out) is None
    assert not out.any()


# ---- torch.ao's re-binning -------------------------------------------------------------------

def test_upscale_with_upsample_rate_zero_is_torch_aos():
    """Rate 0 is no C input (a positive int only): torch.ao's ops make no pieces, so the
    old counts vanish, as torch.ao's int64 zeros from its empty weighted ``bincount``."""
    hist = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ref = TorchHistogramObserver(bins=4)
    ref.upsample_rate = 0
    want = ref._upscale_histogram(hist, *(torch.tensor(v) for v in (0.0, 1.0, -1.0, 2.0)))
    got = A.upscale(hist, 0.0, 1.0, -1.0, 2.0, rate=0)
    assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize(("first", "second", "counts"), [
    # a one-value state: torch.ao's histc of its bf16 min_val puts 0.51953125 in bin 99 of
    # [-3.9375, 0.57421875] (bin 98 in float32)
    pytest.param([0.51953125] * 3, [-3.9375, 0.57421875], None, id="one-value"),
    # a re-binned state: the pieces' width in bf16 moves some to another bin than in float32
    pytest.param([-2.84375, 0.9609375], [-3.109375, 1.4140625], torch.arange(1.0, 106.0),
                 id="upscaled")])
def test_bfloat16_state_widens_as_torch_ao(first, second, counts):
    """A ``.bfloat16()`` observer's wider range re-bins its state in bf16, the state's dtype,
    as torch.ao's (``update``'s ``dtype``)."""
    bins = 100 if counts is None else 105
    ref, ours = (obs(bins=bins).bfloat16() for obs in (TorchHistogramObserver,
                                                       HistogramObserver))
    for obs in (ref, ours):
        obs(torch.tensor(first, dtype=torch.bfloat16))
        if counts is not None:
            obs.histogram.copy_(counts)
        obs(torch.tensor(second, dtype=torch.bfloat16))
    assert ours.histogram.dtype == torch.bfloat16
    assert torch.equal(ours.histogram, ref.histogram)
    assert torch.equal(ours.min_val, ref.min_val) and torch.equal(ours.max_val, ref.max_val)
