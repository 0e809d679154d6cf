"""What apply() leaves on a module travels with a copy of it: a module copied out of an
applied model (``copy.deepcopy``, ``torch.save``) carries the fake-quantized weight and the
activation hooks with no handle to remove them, so calibrate() and apply() refuse it (they
calibrated the quantized values); and remove() finds a weight parametrized after apply()."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import quantscope
from quantscope import fake_quantize


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16)).eval()


BATCHES = [torch.randn(4, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _pickled(module):
    f = io.BytesIO()
    torch.save(module, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


@pytest.mark.parametrize("preset", ["w8a8", "w4a16"])  # hooks and weights; weights alone
@pytest.mark.parametrize("how", [copy.deepcopy, _pickled])
def test_a_module_copied_out_of_an_applied_model_is_refused(preset, how):
    model = _model()
    calib = quantscope.calibrate(model, BATCHES, preset, progress=False)
    with calib.apply(model):
        part = how(model[0])
    st = calib.states["0"]["weight"]
    # the copy holds the fake-quantized weight: calibrating it would give its ranges
    assert torch.equal(part.weight, fake_quantize(model[0].weight, st.qparams, st.spec))
    # a copy of the float module is taken
    own = quantscope.calibrate(nn.Sequential(copy.deepcopy(model[0])), BATCHES, preset,
                               progress=False)
    for call in (lambda m: quantscope.calibrate(m, BATCHES, preset, progress=False),
                 own.apply):
        with pytest.raises(ValueError, match=r"module '0' \(Linear\) has quantscope QDQ "
                                             r"applied by another apply\(\), or is a copy"):
            call(nn.Sequential(part))
    with calib.apply(model):  # the original is applied and removed as before
        pass
    assert not hasattr(model[0], "_quantscope_qdq_part")


def test_a_whole_applied_model_copied_is_taken_once_its_handle_is_removed():
    model = _model()
    calib = quantscope.calibrate(model, BATCHES, "w8a8", progress=False)
    with calib.apply(model):
        dup = copy.deepcopy(model)
    with pytest.raises(ValueError, match="the model has quantscope QDQ applied"):
        quantscope.calibrate(dup, BATCHES, "w8a8", progress=False)
    dup._quantscope_qdq.remove()  # the copy's own handle clears the copy's marks
    again = quantscope.calibrate(dup, BATCHES, "w8a8", progress=False)
    assert torch.equal(again.states["0"]["weight"].qparams.scale,
                       calib.states["0"]["weight"].qparams.scale)


class _Twice(nn.Module):
    def forward(self, w):
        return w * 2


class _Halved(_Twice):
    def right_inverse(self, w):  # stores w / 2: not the fake-quantized weight's values
        return w / 2


def test_remove_restores_a_weight_parametrized_after_apply():
    model = _model()
    float_w = model[0].weight.detach().clone()
    handle = quantscope.calibrate(model, BATCHES, "w8a8", progress=False).apply(model)
    parametrize.register_parametrization(model[0], "weight", _Twice())
    handle.remove()
    assert torch.equal(model[0].parametrizations.weight.original, float_w)
    assert torch.equal(model[0].weight, float_w * 2)  # the user's parametrization, on floats


def test_remove_refuses_a_weight_parametrized_through_a_right_inverse_and_changes_nothing():
    model = _model()
    x = BATCHES[0]
    handle = quantscope.calibrate(model, BATCHES, "w8a8", progress=False).apply(model)
    parametrize.register_parametrization(model[0], "weight", _Halved())
    y = model(x)
    with pytest.raises(ValueError, match=r"remove: 0\.weight was parametrized after apply\(\) "
                                         r"through a right_inverse"):
        handle.remove()
    assert handle.active and torch.equal(model(x), y)  # still applied: hooks and weights
    parametrize.remove_parametrizations(model[0], "weight")
    handle.remove()
    assert not handle.active
