"""stats.ao_histogram and stats.hist_ops where s66's mutants changed behaviour no test saw (the
file came from a mutation round): ``quantscope::ao_histc``'s refusals (no bins, a ``lo`` past
float32, in the fake too) and its binning of 16-bit batches as float32 values, a ``base`` of
the wrong size, the nested-batch refusal, ``ends`` in float64 for a float64 state,
``drop_inf`` (both infinities, the warning at the caller), ``rounds_to_inf`` as torch's
rounding, a bool ``upsample_rate`` refused as torch.ao refuses it, the re-binning of a bf16
state and of a one-value state, where ``observe`` does not apply (``2 ** 24`` values, no
bins, ends of several values), torch.ao's float32 state under a float64 default dtype, and
``hist_add``'s argument checks and its ``absolute`` flag. Values and errors from the
docstrings and torch.ao."""

from __future__ import annotations

import math

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


# ---- quantscope::ao_histc ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_ao_histc_refuses_zero_bins_with_a_value_error(device, forbid_host_sync):
    forbid_host_sync()
    with pytest.raises(ValueError, match="quantscope::ao_histc: bins must be a positive"):
        A.ao_histc(torch.ones(3, device=device), 0, 0.0, 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_ao_histc_refuses_a_lo_below_float32_range(device, forbid_host_sync):
    with pytest.raises(RuntimeError):  # torch.histc's own refusal
        torch.histc(torch.ones(3), 8, -1e39, 0.0)
    forbid_host_sync()
    with pytest.raises(ValueError, match="quantscope::ao_histc: lo must be"):
        A.ao_histc(torch.ones(3, device=device), 8, -1e39, 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_ao_histc_fake_gives_float32_counts_for_a_16_bit_batch(dtype):
    got = A.ao_histc(torch.ones(5, dtype=dtype, device="meta"), 7, 0.0, 1.0)
    assert got.dtype == torch.float32 and got.shape == (7,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_ao_histc_and_histc_bin_a_16_bit_batch_as_its_float32_values(dtype):
    """torch.histc in the batch's 16-bit arithmetic puts values near the edges in other bins;
    ``ao_histc`` and ``histc`` (its torch path: no kernel for 16-bit batches) are
    torch.histc of ``x.float()``, float32 counts."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5000, generator=g) * 3).to(dtype)
    want = torch.histc(x.float(), 100, min=-2.0, max=2.5)
    for got in (A.ao_histc(x, 100, -2.0, 2.5), A.histc(x, 100, -2.0, 2.5)):
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("size", [3, 5])
def test_histc_refuses_a_base_of_another_size(size):
    """``base`` must hold ``bins`` values: a base of another size is no kernel input (it
    would read or add past it); the torch path's reshape refuses it."""
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="shape"):
        A.histc(x, 4, -1.0, 1.0, base=torch.zeros(size))


@needs_ao_kernel
def test_fused_does_not_apply_to_a_base_of_another_size():
    x = torch.rand(100)
    assert A.fused(x, 4, 0.0, 1.0, torch.zeros(5)) is None
    assert A.fused(x, 4, 0.0, 1.0, torch.zeros(4)) is not None


# ---- batch checks, ends, inf ---------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_check_dense_refuses_a_nested_batch_as_torch_ao_does():
    nested = torch.nested.nested_tensor([torch.randn(3), torch.randn(4)])
    with pytest.raises(NotImplementedError) as want:
        TorchHistogramObserver()(nested)
    with pytest.raises(type(want.value), match="got a nested tensor"):
        A.check_dense("HistogramObserver", nested)


def test_ends_of_a_float64_state_are_read_in_float64():
    x = torch.tensor([0.5, 2.0])
    got = A.ends(x, torch.tensor(0.1, dtype=torch.float64), torch.tensor(1.3, dtype=torch.float64))
    assert got == [0.5, 2.0, 0.1, 1.3]  # 0.1 and 1.3 as float64, not float32-rounded


def test_drop_inf_drops_both_infinities_with_torch_aos_warning():
    x = torch.tensor([1.0, math.inf, -2.0, -math.inf, 3.0])
    with pytest.warns(UserWarning, match="torch.inf detected in input tensor") as rec:
        got = A.drop_inf(x, stacklevel=1)
    assert got.tolist() == [1.0, -2.0, 3.0]
    assert rec[0].filename == __file__  # stacklevel 1: the caller of drop_inf


@pytest.mark.parametrize(("value", "dtype", "inf"), [
    (65519.0, torch.float16, False), (65520.0, torch.float16, True),  # fp16 max 65504
    (-65519.0, torch.float16, False),
    (float(torch.finfo(torch.float32).max) + 2.0 ** 102, torch.float32, False),
    (3.3961e38, torch.bfloat16, False), (3.3998e38, torch.bfloat16, True)])  # bf16 3.3895e38
def test_rounds_to_inf_follows_the_rounding_not_the_max(value, dtype, inf):
    """A value past the dtype's max rounds to the max up to half an ulp past it (65504 +
    16 for float16): only then does the state store inf."""
    assert A.rounds_to_inf(value, dtype) is inf


def test_a_bool_upsample_rate_raises_as_torch_ao():
    """torch.ao's ``repeat_interleave(True)`` refuses a bool rate (TypeError); the C path
    takes only a positive int, so a bool is not run as rate 1."""
    ref, ours = TorchHistogramObserver(bins=32), HistogramObserver(bins=32)
    for obs in (ref, ours):
        obs.upsample_rate = True
        obs(torch.linspace(-1.0, 1.0, 50))
    for obs in (ref, ours):
        with pytest.raises(TypeError, match="repeat_interleave"):
            obs(torch.linspace(-3.0, 3.0, 50))


def test_upscale_takes_the_piece_width_in_a_bfloat16_states_dtype():
    """torch.ao's ``_upscale_histogram`` of a bf16 state computes the pieces' width in bf16
    (its ``min_val`` / ``max_val``): here a piece's mid point falls in another bin than with a
    float32 width, so float32 counts of a bf16 state take the torch path, as torch.ao's."""
    ends = [torch.tensor(v, dtype=torch.bfloat16) for v in (-2.84375, 0.9609375, -3.109375,
                                                             1.4140625)]
    hist = torch.arange(1.0, 106.0)
    want = TorchHistogramObserver(bins=105).bfloat16()._upscale_histogram(hist, *ends)
    for given in (ends, [float(e) for e in ends]):
        assert torch.equal(A.upscale(hist, *given, dtype=torch.bfloat16), want)


def test_a_one_value_range_moves_its_whole_total_as_torch_ao():
    """A state of one value (``min_val == max_val``) moves ``histogram.sum()`` to the bin of
    that value on the wider range (torch.ao's ``histc(min_val) * histogram.sum()``), also
    for counts spread over several bins (a loaded state)."""
    hist = torch.tensor([0.0, 3.0, 0.0, 5.0])
    ref = TorchHistogramObserver(bins=4)
    ref(torch.ones(1))
    ref.histogram.copy_(hist)
    x = torch.tensor([0.0, 4.0])
    ref(x)
    got, lo, hi = A.update(hist, (1.0, 1.0), x, (0.0, 4.0), 4)
    assert (lo, hi) == (0.0, 4.0) and torch.equal(got, ref.histogram)
    assert got.tolist() == [1.0, 8.0, 0.0, 1.0]  # 1.0 of [0, 4] in bin 1


# ---- observe: where the C path does not apply ----------------------------------------------

def _state():
    return torch.zeros(8), torch.tensor([-5.0]), torch.tensor([5.0])


@needs_ao_kernel
def test_observe_does_not_take_a_batch_of_2_to_the_24_values():
    """From 2 ** 24 values float32 counts saturate: the torch path takes it (None, nothing
    written); one value fewer runs."""
    big = torch.zeros(1 << 24)
    hist, lo, hi = _state()
    assert A.observe(hist, lo, hi, big) is None
    assert hist.sum() == 0 and (lo.item(), hi.item()) == (-5.0, 5.0)
    assert A.observe(hist, lo, hi, big[:-1]) is False
    assert hist.sum() == (1 << 24) - 1


@needs_ao_kernel
def test_observe_does_not_apply_without_bins_or_to_ends_of_several_values():
    x = torch.randn(100)
    assert A.observe(torch.zeros(0), torch.tensor([1.0]), torch.tensor([2.0]), x, True) is None
    hist, lo, hi = torch.zeros(8), torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0])
    assert A.observe(hist, lo, hi, x, first=True) is None
    assert hist.sum() == 0 and lo.tolist() == [1.0, 0.0] and hi.tolist() == [2.0, 0.0]


@pytest.mark.parametrize("rate", [4, 16])
def test_float32_state_under_a_float64_default_equals_torch_ao(rate):
    """Under ``set_default_dtype(float64)`` torch.ao's edges (``linspace``) are float64 while
    a ``.float()`` observer's state is float32: the C path must not read those edges as
    float32, and the torch path it falls back to keeps the observer's ``upsample_rate``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ref, ours = TorchHistogramObserver(bins=64).float(), HistogramObserver(bins=64).float()
        g = torch.Generator().manual_seed(rate)
        for obs in (ref, ours):
            obs.upsample_rate = rate
        for s in (1.0, 2.0, 5.0, 0.5):
            x = torch.randn(500, generator=g, dtype=torch.float32) * s
            ref(x)
            ours(x)
            assert ours.histogram.dtype == torch.float32
            assert torch.equal(ref.histogram, ours.histogram)
            assert torch.equal(ref.min_val, ours.min_val)
            assert torch.equal(ref.max_val, ours.max_val)
    finally:
        torch.set_default_dtype(old)


# ---- quantscope::hist_add -------------------------------------------------------------------

def _bad_add_args(device):
    """(argument named, hist_add's arguments with that one bad), on ``device``."""
    counts = torch.zeros(2, 16, dtype=torch.int64, device=device)
    units = torch.randn(2, 5, device=device)
    exp = torch.zeros(2, dtype=torch.int64, device=device)
    cases = {
        "counts": [counts.float(), counts[0], torch.zeros(16, 2, dtype=torch.int64,
                                                          device=device).t()],
        "units": [units[:1], units.double()],
        "exp": [exp.int(), torch.zeros(3, dtype=torch.int64, device=device)],
        "first": [exp.int(), torch.zeros(1, dtype=torch.int64, device=device)],
    }
    good = {"counts": counts, "units": units, "exp": exp, "first": exp.clone()}
    for name, bads in cases.items():
        for bad in bads:
            yield name, {**good, name: bad}


@pytest.mark.parametrize("device", DEVICES)
def test_hist_add_refuses_each_bad_argument_by_name(device, forbid_host_sync):
    forbid_host_sync()
    for name, args in _bad_add_args(device):
        with pytest.raises(ValueError, match=rf"quantscope::hist_add: {name} must be"):
            hist_ops.hist_add(args["counts"], args["units"], args["exp"], args["first"], False)


@pytest.mark.parametrize("absolute", [False, True])
def test_hist_add_counts_as_the_torch_reference(absolute):
    """``absolute=True`` counts ``|x|`` (the torch reference ``_add_values_torch``)."""
    st = H._update_grid(H.empty_state(2, 16), torch.zeros(2), torch.tensor([1.0, 2.0]),
                        absolute)
    units = torch.linspace(-2.0, 2.0, 40).reshape(2, 20)
    counts = st.counts.clone()
    hist_ops.hist_add(counts, units, st.exp, st.first, absolute)
    want = H._add_values_torch(st.counts.clone(), units, st.exp, st.first, absolute)
    assert torch.equal(counts, want) and int(counts.sum()) == 40
