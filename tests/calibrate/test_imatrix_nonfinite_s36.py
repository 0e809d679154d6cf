"""``imatrix_mse`` weights beside observers that read NaN / inf as zero (s36).

With ``non_finite="ignore"`` on a layer's roles, one inf in its input was summed into the
layer's importance, so the weight was searched unweighted ("its input brought NaN or inf")
while every observer of the layer had read the inf as zero. The pass's importance now reads
it as zero too, as ``auto``'s own importance does."""

import warnings

import torch
from torch import nn

from quantscope import presets
from quantscope.calibration import calibrate
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.observers.imatrix import IMatrixMSEObserver


def _batches():
    g = torch.Generator().manual_seed(1)
    # input channels far apart in scale: the weighted search differs from the unweighted one
    xs = [torch.randn(4, 32, generator=g) * torch.linspace(0.01, 20, 32) for _ in range(3)]
    xs[1][0, 3] = float("inf")
    return xs


def _recipe(non_finite):
    return Recipe((Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, "imatrix_mse"),
                        input=Role(presets.INT8_PER_TENSOR, "minmax",
                                   options={"non_finite": non_finite})),))


def test_an_ignored_inf_keeps_the_weight_weighted():
    torch.manual_seed(0)
    model, xs = nn.Sequential(nn.Linear(32, 16)).eval(), _batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = calibrate(model, xs, _recipe("ignore"), progress=False)
    assert "imatrix_unweighted" not in c.info
    assert not [w for w in caught if "searched unweighted" in str(w.message)]
    rows = torch.cat(xs).double()
    importance = rows.masked_fill(~rows.isfinite(), 0).square().mean(0).float()
    want = IMatrixMSEObserver(presets.INT8_PER_CHANNEL, importance=importance)
    want(model[0].weight.detach())
    got = c.states["0"]["weight"].qparams.scale
    assert torch.equal(got.reshape(-1), want.calculate_qparams().scale.reshape(-1))
