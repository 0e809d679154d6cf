"""A negative view (``x.conj().imag``, ``torch._neg_view``) is contiguous, but its memory
holds ``-x``: the C kernels read memory, so they must leave it to the torch path
(``kernels.real``). They read it as it lay: min / max flipped, histograms of ``-x``."""

import pytest
import torch

from quantscope import QuantSpec, get_observer
from quantscope.compat import torch_ao
from quantscope.kernels import plain
from quantscope.observers.registry import list_observers

NATIVE = [n for n in list_observers() if ":" not in n and n != "placeholder"]
SPECS = [QuantSpec("int8", "tensor", symmetric=False), QuantSpec("int4", "group:16"),
         QuantSpec("int8", "channel")]


def _neg_view(x):
    v = torch._neg_view(-x)  # x's values, the neg bit set over -x's memory
    assert v.is_neg() and v.is_contiguous() and torch.equal(v, x)
    return v


def test_a_negative_view_is_not_plain():
    assert not plain(_neg_view(torch.randn(4)))


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("name", NATIVE)
def test_native_observers_read_a_negative_view_as_its_values(name, spec):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    try:
        a = get_observer(name, spec)
    except ValueError:
        pytest.skip(f"{name} does not take {spec}")
    a(x)
    b = get_observer(name, spec)
    b(_neg_view(x))
    qa, qb = a.qparams(), b.qparams()
    assert torch.equal(qa.scale, qb.scale) and torch.equal(qa.zero_point, qb.zero_point)


def test_torch_ao_histogram_of_conj_imag_matches_torch_ao():
    from torch.ao.quantization import observer as ao

    t = torch.tensor([[1 + 2j]], dtype=torch.complex64).conj().imag  # [[-2.]], neg bit set
    ours, theirs = torch_ao.HistogramObserver(), ao.HistogramObserver()
    for batch in (torch.tensor([0.0, 5.0]), t):
        ours(batch)
        theirs(batch)
    assert float(ours.min_val) == float(theirs.min_val) == -2.0
    assert torch.equal(ours.histogram, theirs.histogram)
    for a, b in zip(ours.calculate_qparams(), theirs.calculate_qparams(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["minmax", "minmax_channel", "percentile", "modelopt_collect",
                                  "modelopt_forward"])
def test_a_negative_view_on_a_cached_step_gives_its_plain_copys_state(case):
    """The cached CPU steps (minmax_step, hist_step, first_step: ModelOpt's calibrator) read
    memory in C, so each leaves a negative view to the general path: after a plain first
    batch (the state sized), one-signed batches past the first top, as neg views, give the
    state of their plain copies bit for bit (pins F01: first_step testing the type alone,
    ModelOpt's min_vals / max_vals then read from -x's memory)."""
    from quantscope.compat.modelopt import HistogramCalibrator

    def make():
        if case.startswith("modelopt"):
            return HistogramCalibrator(num_bins=64)
        layout = "channel" if case == "minmax_channel" else "tensor"
        return get_observer(case.split("_")[0], QuantSpec("int8", layout))

    gen = torch.Generator().manual_seed(0)
    first = torch.rand(8, 32, generator=gen) * 2 - 1  # in [-1, 1]
    later = [torch.rand(8, 32, generator=gen) * (1.3 + i) + 0.2 for i in range(3)]  # > 0
    viewed, plain_fed = make(), make()
    for obs, views in ((viewed, True), (plain_fed, False)):
        step = obs.collect if case == "modelopt_collect" else obs
        step(first)
        for x in later:
            step(_neg_view(x) if views else x.clone())
    for name, buf in plain_fed._buffers.items():
        assert torch.equal(viewed._buffers[name], buf), name
