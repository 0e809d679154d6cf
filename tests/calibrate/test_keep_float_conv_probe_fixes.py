"""``Outliers(keep_float=n)`` ranks convolutions' inputs too: ``layer_sensitivity`` measures
a conv's output error with the conv itself (it ranked 2-D weight layers only, so a Conv2d's
input, the most damaging tensor, was never kept float, and a conv-only recipe failed with
an error naming the internal function); a transposed conv alone is refused naming
``Outliers(keep_float=)``."""

import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Outliers
from quantscope.calibration.choice.sensitivity import layer_sensitivity
from quantscope.observers.runtime import qdq_tensor

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KW = {"progress": False}


def _recipe(*targets):
    return quantscope.calibrate.preset("w8a8", targets=list(targets))


def _outlier_batches(k=3):
    torch.manual_seed(0)
    out = []
    for _ in range(k):
        x = torch.randn(4, 3, 8, 8) * 0.1
        x[:, 0, 0, 0] = 300.0  # one pixel: a per-tensor int8 range crushes the rest
        out.append(x)
    return out


def test_keep_float_takes_the_conv_input_sensitivity_ranks_first():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        model[0].weight[:, 0] = 0  # the outlier's channel unused: its range is pure damage
    batches, rec = _outlier_batches(), _recipe("Conv2d", "Linear")
    sens = quantscope.sensitivity(model, batches, rec, progress=False)
    assert sens.top(1) == [("0", "input")]
    c = quantscope.calibrate(model, batches, rec, outliers=Outliers(keep_float=1), **KW)
    assert c.info["keep_float"]["tensors"] == ["0 input"]


def test_conv_only_recipe_keeps_one_float():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, groups=4, stride=2)).eval()
    with torch.no_grad():
        model[0].weight[:, 0] = 0
    c = quantscope.calibrate(model, _outlier_batches(), _recipe("Conv2d"),
                             outliers=Outliers(keep_float=1, fallback="float"), **KW)
    assert c.info["keep_float"]["tensors"] == ["0 input"]
    assert "input" not in c.states["0"] and "input" in c.states["2"]


@pytest.mark.parametrize("conv, shape", [
    (nn.Conv1d(3, 6, 3, stride=2), (5, 3, 16)),
    (nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2), (3, 4, 9, 9)),
    (nn.Conv3d(3, 2, 1), (2, 3, 4, 4, 4)),
    (nn.Conv2d(3, 5, 3), (3, 8, 8)),  # unbatched
])
def test_conv_error_is_its_own_output_error(conv, shape):
    torch.manual_seed(0)
    model = nn.Sequential(conv).eval()
    batches = [torch.randn(*shape) for _ in range(2)]
    calib = quantscope.calibrate(model, batches, _recipe(type(conv).__name__), **KW)
    sens = layer_sensitivity(model, batches, calib)
    got = {r["role"]: r["divergence"] for r in sens.rows}
    st = calib.states["0"]
    with torch.no_grad():
        y = [conv._conv_forward(x, conv.weight, None) for x in batches]
        qx = [conv._conv_forward(qdq_tensor(x, st["input"]), conv.weight, None)
              for x in batches]
        qw = [conv._conv_forward(x, qdq_tensor(conv.weight, st["weight"]), None)
              for x in batches]
    ref = sum(float(a.double().square().sum()) for a in y)
    for role, q in (("input", qx), ("weight", qw)):
        want = sum(float((b - a).double().square().sum()) for a, b in zip(y, q)) / ref
        assert got[role] == pytest.approx(want, rel=1e-4), role


def test_transposed_conv_alone_refused_naming_keep_float():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(3, 8, 3), nn.ReLU()).eval()
    with warnings.catch_warnings(), pytest.raises(
            ValueError, match=r"Outliers\(keep_float=1\) ranks the static inputs of Linear"):
        warnings.simplefilter("ignore")
        quantscope.calibrate(model, [torch.randn(2, 3, 8, 8)], _recipe("ConvTranspose2d"),
                             outliers=Outliers(keep_float=1), **KW)
