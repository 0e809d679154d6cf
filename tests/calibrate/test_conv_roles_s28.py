"""A conv's activation layouts (probe s28): units along the spatial dims of ``[N, C, *S]``
(``channel:-1`` = one scale per image column, per token = one per row of the width) are
refused naming the layer; ``channel:1`` is one scale per channel at run time (static: a
clear refusal, not the false "depends on the batch"); ``keep_float(mode="dynamic")`` leaves
a conv's input float; a lazy module's uninitialized shapes are a ValueError naming it."""

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Outliers, Recipe, Role, Rule, load

KW = {"progress": False}
W = Role(QuantSpec("int8", "channel"), "memoryless_minmax")


def _recipe(layout, dynamic=False, target="Conv2d"):
    return Recipe((Rule((target,), weight=W,
                        input=Role(QuantSpec("int8", layout), "minmax", dynamic=dynamic)),))


def _conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()


def _batches():
    return [torch.randn(2, 4, 6, 10), torch.randn(3, 4, 7, 5)]


@pytest.mark.parametrize("layout, dynamic", [
    ("channel:-1", False), ("channel:-1", True), ("channel:2", True), ("channel:3", False),
    ("token", True)])
def test_conv_activation_along_spatial_dims_refused(layout, dynamic):
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d\) input cannot take .*spatial"
                                         r".*per-tensor.*'channel:1'"):
        quantscope.calibrate(_conv(), _batches(), _recipe(layout, dynamic), **KW)


@pytest.mark.parametrize("preset", ["w8a8-dynamic", "fp8-dynamic"])
def test_per_token_presets_on_a_conv_refused(preset):
    rec = quantscope.calibrate.preset(preset, targets=["Conv2d"])
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d\) input cannot take .*token"):
        quantscope.calibrate(_conv(), _batches(), rec, **KW)


def test_static_channel_1_on_a_conv_refused_without_the_batch_reason():
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d\) input: static .* per-tensor"
                                         r".*dynamic=True .*'channel:1'") as e:
        quantscope.calibrate(_conv(), _batches(), _recipe("channel:1"), **KW)
    assert "depend on the batch" not in str(e.value)


def test_linear_last_dim_layouts_still_taken():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4)).eval()
    xs = [torch.randn(3, 5, 6)]
    c = quantscope.calibrate(model, xs, _recipe("channel:-1", target="Linear"), **KW)
    assert c.states["0"]["input"].qparams.scale.numel() == 6
    c = quantscope.calibrate(model, xs, _recipe("token", True, "Linear"), **KW)
    assert c.states["0"]["input"].dynamic is True


def _per_channel_qdq(x):  # int8 symmetric, one scale per channel (axis 1) of this call
    s = x.abs().amax((0, 2, 3), keepdim=True) / 127.5
    return torch.clamp(torch.round(x / s), -128, 127) * s


def test_dynamic_channel_1_on_a_conv_end_to_end(tmp_path):
    model, xs = _conv(), _batches()
    c = quantscope.calibrate(model, xs, _recipe("channel:1", True), **KW)
    st = c.states["0"]
    assert st["input"].dynamic is True and str(st["input"].spec) == "int8 channel:1 sym"
    wq = quantscope.fake_quantize(model[0].weight.detach(), st["weight"].qparams,
                                  st["weight"].spec)
    x = torch.randn(2, 4, 9, 9)  # another image size than the batches'
    with torch.no_grad():
        with c.apply(model):
            y = model[0](x)
        ref = model[0]._conv_forward(_per_channel_qdq(x), wq, model[0].bias)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    c.save(tmp_path / "c")
    assert load(tmp_path / "c").quantizes_like(c)
    assert "0" in str(c.report())


def _outliers():
    torch.manual_seed(0)
    xs = [torch.randn(4, 3, 8, 8) * 0.1 for _ in range(2)]
    for x in xs:
        x[:, 0, 0, 0] = 300.0
    return xs


def test_keep_float_dynamic_leaves_a_conv_input_float():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 4)).eval()
    with torch.no_grad():
        model[0].weight[:, 0] = 0
    rec = quantscope.calibrate.preset("w8a8", targets=["Conv2d", "Linear"])
    with pytest.warns(UserWarning, match=r"layer '0' input is a convolution's.*float"):
        c = quantscope.calibrate(model, _outliers(), rec,
                                 outliers=Outliers(keep_float=1, fallback="dynamic"), **KW)
    assert c.info["keep_float"]["tensors"] == ["0 input"]
    assert "input" not in c.states["0"] and "weight" in c.states["0"]
    with c.apply(model):
        assert torch.isfinite(model(_outliers()[1])).all()


def test_keep_float_dynamic_still_per_token_on_a_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    xs = [torch.randn(4, 8) for _ in range(2)]
    rec = quantscope.calibrate.preset("w8a8", targets=["Linear"])
    c = quantscope.calibrate(model, xs, rec, outliers=Outliers(keep_float=1, fallback="dynamic"),
                             **KW)
    (layer, role), = [t.split() for t in c.info["keep_float"]["tensors"]]
    assert c.states[layer][role].dynamic is True
    assert c.states[layer][role].spec.layout.kind == "token"


@pytest.mark.parametrize("lazy, x", [
    (lambda: nn.LazyConv2d(8, 3), torch.randn(2, 3, 6, 6)),
    (lambda: nn.LazyLinear(4), torch.randn(2, 5))])
def test_lazy_module_named_with_the_cure(lazy, x):
    model = nn.Sequential(lazy())
    target = "Conv2d" if x.dim() == 4 else "Linear"
    rec = quantscope.calibrate.preset("w8a8", targets=[target])
    with pytest.raises(ValueError, match=r"layer '0' \(Lazy\w+\) has uninitialized lazy "
                                         r"parameters; run one forward"):
        quantscope.calibrate(model, [x], rec, **KW)
    model(x)  # initialized: calibrates
    assert "input" in quantscope.calibrate(model, [x], rec, **KW).states["0"]
