"""A deepcopy of an applied model has a handle of its own, registered while active; where the
copy's weights are taken away (compressed-tensors replaces a Linear's ``weight`` by its codes
in the exporter's copy) and the copy is dropped, its handle stays registered until gc collects
the cycle (review s43). Every later apply / calibrate / export in the process then raised
AttributeError ('Linear' object has no attribute 'weight') reading that handle's weights. A
weight its holders no longer hold is none the handle holds: unrelated models are unaffected,
and the copy's remaining weights are still refused as applied."""

import copy

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration.results import apply as A

torch.set_num_threads(1)


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


X = [torch.randn(4, 8, generator=torch.Generator().manual_seed(0))]


def test_a_copy_whose_weight_is_gone_leaves_other_models_alone():
    model = _model(0)
    cal = quantscope.calibrate(model, X, "w8a8", progress=False)
    with cal.apply(model):
        dup = copy.deepcopy(model)
    del dup[0].weight  # as an exporter's compression of its copy does
    assert dup._quantscope_qdq in set(A._APPLIED)  # (dropped: until gc collects it)
    other = _model(1)
    other_cal = quantscope.calibrate(other, X, "w8a8", progress=False)
    float_w = other[0].weight.detach().clone()
    with other_cal.apply(other):
        assert not torch.equal(other[0].weight, float_w)
    assert torch.equal(other[0].weight, float_w)
    other_cal.check_model(other, "export")
    # the copy's weight it still holds is still its handle's: refused as applied
    with pytest.raises(ValueError, match="has quantscope QDQ applied"):
        quantscope.calibrate(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), dup[2]), X, "w8a8",
                             progress=False)
    assert A.memory(dup[2].weight) in A._held()
    assert A.fake_quantized(dup, ["0", "2"]) == {"0", "2"}  # (the marked copies)
    dup._quantscope_qdq.active = False  # (no remove(): its weight has no place to go back)
    A._track(dup._quantscope_qdq, False)


def test_a_copy_whose_tied_weight_one_holder_lost_leaves_other_models_alone():
    # a weight is held only while every holder still holds it: a copy's tied weight taken
    # from one of its two holders (the other keeps it) is none the handle holds either
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    model[2].weight = model[0].weight
    cal = quantscope.calibrate(model, X, "w8a8", progress=False)
    with cal.apply(model):
        dup = copy.deepcopy(model)
    del dup[0].weight  # dup[2] still holds it
    try:
        other = _model(1)
        other_cal = quantscope.calibrate(other, X, "w8a8", progress=False)
        with other_cal.apply(other):
            pass
        other_cal.check_model(other, "export")
    finally:
        dup._quantscope_qdq.active = False
        A._track(dup._quantscope_qdq, False)
