"""Probe fixes (s29, layers): a run-time (dynamic) input role on a module the forward never
calls (``nn.MultiheadAttention``'s ``out_proj``) follows ``Runtime(missing=...)`` as a static
one does, and ``nn.Bilinear`` (two input tensors) refuses an input role at planning time."""

import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Runtime, preset
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.spec import QuantSpec


# ------------------------------------------- run-time roles on a module never called
class _Attn(nn.Module):
    """``att.out_proj`` is a Linear the attention multiplies by its weight itself."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.att(x, x, x, need_weights=False)[0])


def _attn_calibrate(recipe, missing):
    torch.manual_seed(0)
    model = _Attn().eval()
    batches = [torch.randn(2, 10, 64) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = quantscope.calibrate(model, batches, preset(recipe), progress=False,
                                   runtime=Runtime(missing=missing))
    return cal, [str(w.message) for w in caught]


def test_dynamic_role_never_called_raises_under_missing_error():
    with pytest.raises(ValueError, match=r"'att\.out_proj' input was never called"):
        _attn_calibrate("w8a8-dynamic", "error")
    with pytest.raises(ValueError, match=r"'att\.out_proj' input was never called"):
        _attn_calibrate("w8a8", "error")  # the static peer: the same error


def test_dynamic_role_never_called_skip_matches_static_record():
    cal, warned = _attn_calibrate("w8a8-dynamic", "skip")
    want = [{"layer": "att.out_proj", "role": "input", "calls": 0,
             "fallback": "input not quantized"}]
    assert cal.info["missing"] == want
    assert set(cal.states["att.out_proj"]) == {"weight"}  # weight-only, as applied
    assert cal.states["head"]["input"].dynamic is True  # the called layer keeps its role
    assert any("'att.out_proj' input: input not quantized" in w for w in warned)
    static, static_warned = _attn_calibrate("w8a8", "skip")
    assert static.info["missing"] == want  # the static preset's record, word for word
    assert [w for w in warned if "saw no tokens" in w] == \
        [w for w in static_warned if "saw no tokens" in w]


def test_dynamic_role_never_called_float_leaves_layer_float():
    cal, _ = _attn_calibrate("w8a8-dynamic", "float")
    assert "att.out_proj" not in cal.states
    assert cal.info["missing"][0]["fallback"] == "float layer"
    assert set(cal.states["head"]) == {"weight", "input"}


class _Empty(nn.Module):
    """``side`` is called on every batch, always with 0 rows."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(x) + self.side(x[:0]).sum()


def test_dynamic_role_called_with_zero_rows_keeps_its_runtime_scale():
    """A run-time scale needs no data and apply's hook sees those calls: kept. A static role
    there has no range and follows ``missing``."""
    torch.manual_seed(0)
    model, batches = _Empty(), [torch.randn(4, 16) for _ in range(2)]
    cal = quantscope.calibrate(model, batches, "w8a8-dynamic", progress=False,
                               runtime=Runtime(missing="error"))
    assert cal.states["side"]["input"].dynamic is True and "missing" not in cal.info
    with pytest.raises(ValueError, match=r"'side' input was called 2 times but saw no tokens"):
        quantscope.calibrate(model, batches, "w8a8", progress=False,
                             runtime=Runtime(missing="error"))


def test_dynamic_roles_without_batches_are_kept():
    """No batch forwarded: no call proves a module unused (a run-time recipe needs none)."""
    cal = quantscope.calibrate(_Attn(), [], "w8a8-dynamic", progress=False,
                               runtime=Runtime(missing="error"))
    assert cal.states["att.out_proj"]["input"].dynamic is True
    assert cal.states["head"]["input"].dynamic is True


# ------------------------------------------------------------------- nn.Bilinear
class _Bil(nn.Module):
    def __init__(self, in2=32):
        super().__init__()
        self.bil = nn.Bilinear(32, in2, 5)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return self.bil(x, 3 * x.repeat(1, self.bil.in2_features // 32))


@pytest.mark.parametrize("name", ["w8a8", "fp8", "w8a8-dynamic", "nvfp4"])
def test_bilinear_input_role_refused_before_any_forward(name):
    model = _Bil()
    with pytest.raises(ValueError, match=r"layer 'bil' \(Bilinear\) input: .*two input "
                                         r"tensors.*weight-only.*ignore"):
        quantscope.calibrate(model, [torch.randn(4, 32)], preset(name, targets=["Bilinear"]),
                             progress=False)
    assert model.forwards == 0


def test_bilinear_ignored_by_activation_preset():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _Bil())
    recipe = preset("w8a8", targets=["Linear", "Bilinear"], ignore=["1.bil"])
    cal = quantscope.calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    assert set(cal.states) == {"0"}


def test_bilinear_weight_only_per_channel_applies_to_both_inputs():
    """The weight [out, in1, in2] per output channel: x1^T Wq x2 with Wq by the formula."""
    torch.manual_seed(0)
    model = _Bil()
    x = torch.randn(4, 32)
    recipe = Recipe((Rule(("Bilinear",), weight=Role(QuantSpec("int8", "channel"),
                                                      "minmax")),))
    cal = quantscope.calibrate(model, [x], recipe, progress=False)
    assert set(cal.states["bil"]) == {"weight"}
    w = model.bil.weight.detach().clone()
    # int8 symmetric: amax spans 127.5 steps, codes in [-128, 127] (as compressed-tensors)
    scale = w.abs().amax(dim=(1, 2), keepdim=True) / 127.5
    wq = torch.clamp(torch.round(w / scale), -128, 127) * scale
    with torch.no_grad():
        want = nn.functional.bilinear(x, 3 * x, wq, model.bil.bias)
        with cal.apply(model):
            got = model(x)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(wq, w)  # the check sees the quantization


def test_bilinear_w4a16_groups_along_in2():
    torch.manual_seed(0)
    model = _Bil(in2=128)
    cal = quantscope.calibrate(model, [torch.randn(4, 32)], preset("w4a16",
                               targets=["Bilinear"]), progress=False)
    state = cal.states["bil"]["weight"]
    assert set(cal.states["bil"]) == {"weight"}
    assert tuple(state.qparams.scale.shape) == (5, 32, 1)  # one group of 128 per (out, in1)
