"""Probe fixes (s26, sharing): a recipe of ``calibrate_many`` gets what ``calibrate`` gives it
alone. A weight-only auto recipe under ``Auto(metric="output")`` chose its weights by
another recipe's input sample; a user's ``(label, observer)`` tuple label was silently
replaced by auto's candidate of that name; ``info["auto"]["score_forwards"]`` added up the
scoring forwards of every auto recipe of the call."""

import pytest
import torch
from torch import nn

from quantscope.calibration import Auto, calibrate, calibrate_many, preset

KW = {"progress": False}


class _Attn(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 256), nn.Linear(256, d)

    def forward(self, x):
        h = self.o_proj(self.q_proj(x) * torch.sigmoid(self.k_proj(x)) + self.v_proj(x)) + x
        return self.down(torch.relu(self.up(h)))


def test_weight_only_output_metric_ignores_another_recipes_input_sample():
    torch.manual_seed(0)
    model = _Attn().eval()
    batches = [torch.randn(2, 16, 128) * 3 for _ in range(3)]
    batches[0][0, 0, 5] = 60.0  # an outlier: x W^T and the tensor error choose apart
    auto = Auto(metric="output")
    alone = calibrate(model, batches, preset("w4a16", "auto"), auto=auto, **KW)
    many = calibrate_many(model, batches, {"w4a16": preset("w4a16", "auto"),
                                           "w8a8": preset("w8a8")}, auto=auto, **KW)["w4a16"]
    assert alone.states.keys() == many.states.keys()
    for layer, roles in alone.states.items():
        assert many.states[layer]["weight"].observer == roles["weight"].observer, layer
        assert torch.equal(many.states[layer]["weight"].qparams.scale,
                           roles["weight"].qparams.scale), layer


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).eval()
    return model, [torch.randn(2, 8, 32) * 3 for _ in range(2)]


def test_calibrate_many_refuses_a_tuple_label_next_to_auto():
    model, batches = _mlp()
    with pytest.raises(TypeError, match=r"a recipe label must be a str, got \('a', 'minmax'\)"):
        calibrate_many(model, batches, {("a", "minmax"): "fp8", "a": preset("w8a8", "auto")},
                       **KW)
    # auto's own (label, observer) candidates still run inside: only str labels come back
    out = calibrate_many(model, batches, {"a": preset("w8a8", "auto"), "b": "fp8"}, **KW)
    assert set(out) == {"a", "b"} and out["b"].recipe.name == "fp8"


def test_score_forwards_are_each_auto_recipes_own():
    model, batches = _mlp()
    a, b = preset("w8a8", "auto"), preset("fp8", "auto")
    alone = {r.name: calibrate(model, batches, r, **KW).info["auto"]["score_forwards"]
             for r in (a, b)}
    for order in ([a, b], [b, a]):
        got = calibrate_many(model, batches, order, **KW)
        assert {k: c.info["auto"]["score_forwards"] for k, c in got.items()} == alone
