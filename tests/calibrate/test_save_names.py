"""Every module name round-trips through save / load: a layer named ``#smooth`` stores its
``{layer}/{role}/{field}`` tensors under the prefix of SmoothQuant's scales (``#smooth/``),
and load tells the two apart by the roles its JSON lists."""

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

from quantscope.calibration import calibrate, load
from quantscope.calibration.results.result import Calibration


def _model(*names):
    torch.manual_seed(0)
    model = nn.Sequential()
    for n in names:
        model.add_module(n, nn.Linear(16, 16))
    g = torch.Generator().manual_seed(1)
    return model.eval(), [torch.randn(3, 16, generator=g) for _ in range(3)]


@pytest.mark.parametrize("recipe", ["w8a8", "w8a8-dynamic"])
def test_a_layer_named_like_the_smoothing_prefix_round_trips(tmp_path, recipe):
    model, batches = _model("#smooth", "#smooth/x", "b")
    calib = calibrate(model, batches, recipe, progress=False)
    calib.save(tmp_path / "q")
    back = load(tmp_path / "q")
    assert list(back.states) == ["#smooth", "#smooth/x", "b"]
    assert back.smoothing == {}
    assert back.quantizes_like(calib)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with calib.apply(model):
            want = model(x)
        with back.apply(model):
            got = model(x)
    assert torch.equal(got, want)


def _with_smoothing(calib, smoothing):
    return Calibration(calib.recipe, calib.states, calib.label, info=calib.info,
                       smoothing=smoothing)


def test_smoothing_scales_beside_a_layer_named_smooth_stay_apart(tmp_path):
    model, batches = _model("#smooth", "b")
    calib = calibrate(model, batches, "w8a8", progress=False)
    scales = {"norm": torch.rand(16) + 0.5, "input": torch.rand(16) + 0.5}
    calib = _with_smoothing(calib, scales)
    calib.save(tmp_path / "q")
    back = load(tmp_path / "q")
    assert list(back.states) == ["#smooth", "b"]
    assert back.smoothing.keys() == scales.keys()
    assert back.quantizes_like(calib)


def test_a_smoothing_key_a_role_would_read_is_refused_at_save(tmp_path):
    model, batches = _model("#smooth", "b")
    calib = _with_smoothing(calibrate(model, batches, "w8a8", progress=False),
                            {"input/scale": torch.ones(16)})
    with pytest.raises(ValueError, match=r"'#smooth/input/scale'.*layer '#smooth'.*rename"):
        calib.save(tmp_path / "q")
    assert not (tmp_path / "q").exists()
