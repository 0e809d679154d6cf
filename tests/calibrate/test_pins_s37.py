"""Pins found by mutation (s37): Auto's non-finite option and importance sums, a custom loss's
checks, keep_float on convolutions, tied-weight detection, a transposed convolution's channel
axis, and which trace a sequential run's chain error reports."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Recipe, Rule, keep_float, preset
from quantscope.calibration.choice.importance import InputImportance
from quantscope.calibration.choice.sensitivity import layer_sensitivity
from quantscope.calibration.run.block_order import NotAChain
from quantscope.calibration.run.module_roles import module_role
from quantscope.calibration.structure.tied import tied_weights
from quantscope.layout import Block, Channel


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---- Auto: imatrix candidate and importance -----------------------------------------------------

def test_auto_imatrix_candidate_kept_when_only_the_input_role_ignores_non_finite():
    """One role with non_finite="ignore" (the input's, the weight's left at its default) is
    enough for Auto to read a batch's inf as zero: the run succeeds and still scores the
    imatrix weight candidate instead of refusing the batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    xs = [torch.randn(8, 16) * 3 for _ in range(4)]
    xs[3][2, 3] = float("inf")
    rec = preset("w8a8", "auto", non_finite="ignore")

    def strip(role):
        opts = tuple((k, v) for k, v in role.options if k != "non_finite")
        return dataclasses.replace(role, options=opts)

    rules = tuple(dataclasses.replace(r, weight=strip(r.weight)) if r.weight else r
                  for r in rec.rules)
    rec = dataclasses.replace(rec, rules=rules)
    roles = rec.rules[0].roles()
    assert "non_finite" not in dict(roles["weight"].options)
    assert dict(roles["input"].options).get("non_finite") == "ignore"
    calib = _quiet(quantscope.calibrate, model, xs, rec, progress=False)
    assert "weight=imatrix" in calib.info["auto"]["role_scores"]


def test_input_importance_of_a_float16_model_sums_squares_in_float32():
    """A float16 layer's inputs of ~300 square past float16's max (65504): the importance
    (mean x^2) is summed in float32 and stays finite, near 300^2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).half().eval()
    x = (torch.randn(4, 16) * 300).half()
    imp = InputImportance(model, ["0"])
    with imp.counting(), torch.no_grad():
        model(x)
    means = imp.means()["0"]
    assert torch.isfinite(means).all(), means
    expected = x.float().square().mean(0)
    torch.testing.assert_close(means.float(), expected, rtol=1e-3, atol=0)


# ---- sensitivity: a custom loss -----------------------------------------------------------------

def test_sensitivity_refuses_a_loss_returning_a_bool():
    """A loss returning a bool (a comparison's result) is no divergence: TypeError naming
    the loss and the type, not a divergence of 1.0 / 0.0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    xs = [torch.randn(4, 16) for _ in range(2)]

    def loss(out, ref, batch):
        return bool((out - ref).abs().max() > 1e-3)

    with pytest.raises(TypeError, match=r"loss must return.*got bool"):
        _quiet(quantscope.sensitivity, model, xs, "w8a8", loss=loss)


def test_sensitivity_blames_the_loss_when_logits_hold_minus_inf():
    """Logits with -inf (a banned token) are finite enough: a loss returning NaN there is
    reported as the loss's NaN, not as the quantized model's non-finite output."""

    class Banned(nn.Module):
        def forward(self, x):
            x = x.clone()
            x[..., -1] = float("-inf")
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), Banned()).eval()
    xs = [torch.randn(4, 16) for _ in range(2)]

    def loss(out, ref, batch):
        return (out - ref).sum()  # -inf - -inf = nan

    with pytest.raises(ValueError, match="loss returned nan") as e:
        _quiet(quantscope.sensitivity, model, xs, "w8a8", loss=loss)
    assert "quantized model's output is not finite" not in str(e.value)


# ---- keep_float on convolutions -----------------------------------------------------------------

def test_keep_float_dynamic_leaves_conv1d_inputs_in_float():
    """layer_sensitivity names every convolution (Conv1d too) in info["convolutions"], so
    keep_float(mode="dynamic") leaves a Conv1d's input in float with a warning instead of a
    per-token state over its [N, C, L] input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 8, 3), nn.ReLU(), nn.Conv1d(8, 4, 3)).eval()
    xs = [torch.randn(2, 3, 10) for _ in range(2)]
    rec = Recipe((Rule(("Conv1d",), input=preset("w8a8").rules[0].input),))
    calib = _quiet(quantscope.calibrate, model, xs, rec, progress=False)
    sens = layer_sensitivity(model, xs, calib)
    assert sens.info["convolutions"] == ["0", "2"]
    with pytest.warns(UserWarning, match="convolution"):
        kept = keep_float(calib, sens, 2, mode="dynamic")
    assert not any("input" in roles for roles in kept.states.values()), kept.states


def test_keep_float_dynamic_keeps_a_block_scale_conv_input_dynamic():
    """A convolution input with a block-scale format (NVFP4, Block(16, 1)) keeps its blocks
    under keep_float(mode="dynamic"): a dynamic NVFP4 state, not float, and no warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 1), nn.ReLU(), nn.Conv2d(16, 16, 1)).eval()
    xs = [torch.randn(2, 16, 4, 16) for _ in range(2)]
    r = preset("nvfp4").rules[0].input
    rec = Recipe((Rule(("Conv2d",), input=dataclasses.replace(
        r, spec=dataclasses.replace(r.spec, layout=Block(16, 1)))),))
    calib = _quiet(quantscope.calibrate, model, xs, rec, progress=False)
    sens = layer_sensitivity(model, xs, calib)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        kept = keep_float(calib, sens, 1, mode="dynamic")
    assert not [str(x.message) for x in w if "keep_float" in str(x.message)]
    assert set(kept.states) == {"0", "2"}, kept.states
    moved = [st for roles in kept.states.values() for st in roles.values() if st.dynamic is True]
    assert len(moved) == 1
    assert isinstance(moved[0].spec.layout, Block)


# ---- tied weights -------------------------------------------------------------------------------

def test_tied_weights_of_a_meta_skeleton_are_not_ties():
    """Meta tensors all report one data pointer: two distinct meta Linear(8, 8) weights are
    not tied."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert tied_weights(model, ["0", "1"]) == {}


def test_a_square_weight_and_its_transpose_are_not_tied():
    """W and W.t() of a square weight share storage, offset and shape but not strides: two
    different weights, no tie."""
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    model[1].weight = nn.Parameter(model[0].weight.detach().t())
    assert tied_weights(model, ["0", "1"]) == {}
    model[1].weight = model[0].weight  # a real tie still reads as one
    assert tied_weights(model, ["0", "1"]) == {"0": ["1"], "1": ["0"]}


# ---- module_role: a transposed convolution's channel axis ---------------------------------------

def test_conv_transpose_weight_channel_minus_one_is_left_as_given():
    """A ConvTranspose2d weight's Channel(-1) is its last kernel dim (read modulo the weight's
    dims), no output-channel axis: left as given, also for a grouped one, not moved to
    Channel(1)."""
    w = preset("w8a8").rules[0].weight
    cfg = dataclasses.replace(w, spec=dataclasses.replace(w.spec, layout=Channel(-1)))
    for module in (nn.ConvTranspose2d(4, 6, 3), nn.ConvTranspose2d(4, 6, 3, groups=2)):
        assert module_role("0", "weight", cfg, module).spec.layout == Channel(-1)


# ---- sequential: which trace a NotAChain names --------------------------------------------------

class _Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        k = int(x.shape[1] // 2) + 0 * int(x.abs().sum() > -1)  # a host read: no meta run
        return self.fc(x[:, :k])


class _Halving(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Down() for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.head(x.reshape(x.shape[0], -1))


def test_sequential_chain_error_reports_the_pass_through_trace_when_blocks_cannot_run_on_meta():
    """Blocks that change the shape and cannot run on meta: both traces fail; the error names
    the pass-through trace's failure (the real shape mismatch), not the shaped trace's meta
    failure."""
    torch.manual_seed(0)
    model = _Halving().eval()
    xs = [torch.randn(3, 8, 8) for _ in range(2)]
    with pytest.raises(NotAChain) as e:
        _quiet(quantscope.calibrate, model, xs, "w8a8", progress=False, sequential=True)
    msg = str(e.value)
    assert "giving its input through" in msg, msg
    assert "meta tensors" not in msg
    assert "shapes cannot be multiplied" in msg
