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
