"""Pins from the s70 mutation round over ``calibration/choice/layer_choice.py`` (the per-layer
``joint`` / ``fisher`` criteria): the fisher weights' rows, dtype, labels, batches and unused
layers, the joint descent's order, rounds and precision, and what :func:`layer_pick` prices
and returns (its row sample, the fisher weights, run-time inputs, one-candidate weights, the
weight-only fallback warning). Each test holds a behaviour no earlier test held, checked
against the module's docstrings."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_choice_pins_s63 import _per_tensor
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from quantscope import QuantSpec
from quantscope.calibration import Role
from quantscope.calibration.choice import layer_choice
from quantscope.calibration.choice.layer_choice import (
    JOINT_ROWS,
    fisher_weights,
    imatrix_state,
    joint_choice,
    layer_pick,
)
from quantscope.calibration.results.result import RoleState
from quantscope.calibration.run.observe import observer_key
from quantscope.layout import Tensor, Tile, Token
from quantscope.observers.runtime import qdq_tensor
from quantscope.presets import NVFP4


def _square_sum(out, batch):
    return out.float().square().sum()


# ----------------------------------------------------------------------------- fisher
class _Branches(nn.Module):
    """``used(x)``, with ``unused(x)`` run and thrown away (the loss never sees it) and
    ``no_grad(x)`` run without a graph."""

    def __init__(self):
        super().__init__()
        self.used, self.unused, self.no_grad = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        self.unused(x)
        with torch.no_grad():
            self.no_grad(x)
        return self.used(x)


def test_fisher_gives_no_weights_to_a_layer_whose_output_the_loss_does_not_use():
    """A layer whose output does not reach the loss (or has no graph) has no gradient: it is
    left out of the weights (its errors then count unweighted), not an autograd error."""
    torch.manual_seed(0)
    layers = ["used", "unused", "no_grad"]
    assert fisher_weights(_Branches(), [torch.randn(5, 4)], layers, _square_sum).keys() == {
        "used"}


def test_fisher_thaws_only_the_floating_parameters_of_a_frozen_layer():
    """On a frozen layer only the floating weights require grad for the call (an integer
    parameter cannot): the weights are the unfrozen layer's, every flag restored."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 3)), torch.randn(5, 4)
    want = fisher_weights(model, [x], ["0"], _square_sum)
    model.requires_grad_(False)
    model[0].codes = nn.Parameter(torch.zeros(3, dtype=torch.int8), requires_grad=False)
    got = fisher_weights(model, [x], ["0"], _square_sum)
    assert torch.equal(got["0"], want["0"])
    assert not any(p.requires_grad for p in model.parameters())


def test_fisher_averages_g2_over_every_position_of_a_3d_output_in_float32():
    """The weights are the mean over every output row (each batch's, each sequence
    position's) of ``g^2`` per output feature, in float32 on a bfloat16 layer too: the loss
    ``sum y^2`` has ``g = 2 y``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).to(torch.bfloat16)
    xs = [torch.randn(2, 5, 4, dtype=torch.bfloat16), torch.randn(1, 3, 4, dtype=torch.bfloat16)]
    got = fisher_weights(model, xs, ["0"], _square_sum)["0"]
    with torch.no_grad():
        g = torch.cat([(2 * model(x)).double().reshape(-1, 3) for x in xs])
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert torch.allclose(got.double(), g.square().mean(0), rtol=1e-6, atol=0)


class _Scaled(nn.Module):
    """``lin(x) * scale``, called with a dict batch's keywords."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, scale):
        return self.lin(x) * scale


def test_fisher_clones_a_batchs_inference_tensors_beside_normal_ones():
    """A batch holding any tensor made under ``inference_mode`` (autograd cannot save it) is
    taken as its normal copy: the same weights as the batch made normally."""
    torch.manual_seed(0)
    model, x, scale = _Scaled(), torch.randn(6, 4), torch.tensor(2.0)
    want = fisher_weights(model, [{"x": x, "scale": scale}], ["lin"], _square_sum)
    with torch.inference_mode():
        made_here = x.clone()
    got = fisher_weights(model, [{"x": made_here, "scale": scale}], ["lin"], _square_sum)
    assert torch.equal(got["lin"], want["lin"])


class _Causal(nn.Module):
    """A model with a loss: ``CausalLMOutput(loss=mean (y - labels)^2)`` of
    ``y = lin(inputs_embeds)``; records the labels given."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.labels = []

    def forward(self, inputs_embeds, labels):
        self.labels.append(labels.clone())
        y = self.lin(inputs_embeds).squeeze(-1)
        return CausalLMOutput(loss=(y - labels.float()).square().mean(), logits=y)


def test_fisher_default_loss_takes_labels_without_input_ids():
    """The default loss needs ``labels`` *or* ``input_ids``: a batch of ``inputs_embeds``
    with its own labels is the model's own loss on them."""
    torch.manual_seed(0)
    model = _Causal()
    batch = {"inputs_embeds": torch.randn(2, 5, 1), "labels": torch.randn(2, 5)}
    got = fisher_weights(model, [batch], ["lin"])
    want = fisher_weights(model, [batch], ["lin"], lambda out, b: out.loss)
    assert torch.equal(model.labels[0], batch["labels"])
    assert got.keys() == {"lin"} and torch.equal(got["lin"], want["lin"])


# ----------------------------------------------------------------------------- joint descent
def test_imatrix_state_refuses_a_conv1d_weights_tiles():
    """A Conv1D's ``[in, out]`` weight is searched as ``w.T``: same units in the same order,
    except tiles, whose order transposes: refused (layer_pick then adds no imatrix state)."""
    base = RoleState(QuantSpec("int8", Tile(2, 2)), "minmax", "auto")
    with pytest.raises(ValueError, match=r"imatrix: a Conv1D's weight tiles are not searched"):
        imatrix_state(torch.randn(4, 6), torch.ones(4), base, conv1d=True)


def _int8_states(t, factors):
    spec = QuantSpec("int8")
    return [_per_tensor(spec, float(t.abs().max()) * f, f"f{f}") for f in factors]


def test_joint_choice_prices_the_error_in_float32_on_low_precision_tensors():
    """``x`` and ``w`` are priced as float32 (their QDQ and the reference output alike): on
    bfloat16 tensors the pick and the error are those of their float32 copies."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    ws, xs = _int8_states(w, (1.0, 0.8)), _int8_states(x, (1.0, 0.6, 0.3))
    assert joint_choice(x, w, ws, xs) == joint_choice(x.float(), w.float(), ws, xs)


def test_joint_choice_sums_the_squared_errors_in_float64():
    """The error is the sum of the squared output errors accumulated in float64: exact to
    float64 rounding where a float32 running sum of many terms is not."""
    torch.manual_seed(0)
    x, w = torch.randn(4096, 16), torch.randn(64, 16)
    ws, xs = _int8_states(w, (1.0,)), _int8_states(x, (0.5,))
    _i, _j, e = joint_choice(x, w, ws, xs)
    sq = (qdq_tensor(x, xs[0]) @ qdq_tensor(w, ws[0]).T - x @ w.T).square()
    assert e == pytest.approx(math.fsum(sq.double().flatten().tolist()), rel=1e-12, abs=0)


class _Fixed:
    """A candidate whose QDQ is the given tensor (the descent prices only those)."""

    def __init__(self, name, value):
        self.observer, self.value = name, torch.tensor([[value]])


@pytest.fixture()
def fixed_qdq(monkeypatch):
    """layer_choice's QDQ: each :class:`_Fixed` candidate's own value."""
    monkeypatch.setattr(layer_choice, "qdq_tensor", lambda t, state: state.value)


def test_joint_descent_picks_the_weight_first_then_the_input_given_it(fixed_qdq):
    """One round is the weight given the first (min-max) input, then the input given that
    weight. x = w = 1: ``err(i, j) = (xq_j wq_i - 1)^2``; weight first gives (1, 1), the
    input first would give (1, 0)."""
    one = torch.ones(1, 1)
    ws = [_Fixed("w0", 1.0), _Fixed("w1", 0.5)]
    xs = [_Fixed("x0", 1.5), _Fixed("x1", 2.0)]
    assert joint_choice(one, one, ws, xs)[:2] == (1, 1)


def test_joint_descent_keeps_the_first_of_two_equal_input_candidates(fixed_qdq):
    """Ties keep the first input candidate (min-max by convention), as they do a weight."""
    one = torch.ones(1, 1)
    xs = [_Fixed("x0", 1.5), _Fixed("x1", 1.5)]
    assert joint_choice(one, one, [_Fixed("w0", 1.0)], xs)[:2] == (0, 0)


def test_joint_descent_runs_one_round_at_least_and_more_when_asked(fixed_qdq):
    """``rounds`` below 1 still runs one round; a second round re-picks the weight given the
    input the first round chose. Round 1: w1 given x0 (0.01 < 0.0139 < 0.25), x1 given w1
    (0.0004); round 2: w2 given x1 (0)."""
    one = torch.ones(1, 1)
    ws = [_Fixed("w0", 1.0), _Fixed("w1", 0.6), _Fixed("w2", 1 / 1.7)]
    xs = [_Fixed("x0", 1.5), _Fixed("x1", 1.7)]
    assert joint_choice(one, one, ws, xs, rounds=0)[:2] == (1, 1)
    assert joint_choice(one, one, ws, xs, rounds=1)[:2] == (1, 1)
    assert joint_choice(one, one, ws, xs, rounds=2)[:2] == (2, 1)


# ----------------------------------------------------------------------------- layer_pick
class _Slot(SimpleNamespace):
    """A session slot (weak-referenceable, as the fallback warning's memo needs)."""


def _pick(weights, inputs, x, fisher=None, wcfg=None, xcfg=None, linear=None):
    """:func:`layer_pick` on layer ``fc`` with the candidate states ``weights`` / ``inputs``
    (``{name: state}``; a slot's observer is its state) and the input sample ``x``."""
    spec = QuantSpec("int8", Tensor())
    wcfg, xcfg = wcfg or Role(spec, "auto"), xcfg or Role(spec, "auto")
    linear = linear or nn.Linear(8, 6)
    slots = {("fc", "weight"): _Slot(module=linear, observers={
                 observer_key(n, wcfg): st for n, st in weights.items()}),
             ("fc", "input"): _Slot(observers={
                 observer_key(n, xcfg): st for n, st in inputs.items()})}
    plan = {("fc", "weight"): (wcfg, list(weights)), ("fc", "input"): (xcfg, list(inputs))}
    data = {} if x is None else {("fc", "input"): x}
    return layer_pick("fc", plan, slots, data, lambda obs, cfg, key, shape: obs, fisher)


def _candidates(w, x):
    spec = QuantSpec("int8", Tensor())
    amax_w, amax_x = float(w.abs().max()), float(x.abs().max())
    weights = {"minmax": _per_tensor(spec, 100 * amax_w, "minmax"),
               "mse": _per_tensor(spec, amax_w, "mse")}
    inputs = {"minmax": _per_tensor(spec, amax_x, "minmax"),
              "percentile": _per_tensor(spec, amax_x / 2, "percentile")}
    return weights, inputs


def _errors(x, w, wstate, inputs, c=None):
    wq, ref = qdq_tensor(w, wstate), x @ w.T
    out = {}
    for name, st in inputs.items():
        e = (qdq_tensor(x, st) @ wq.T - ref).square()
        out[name] = float((e if c is None else e * c).double().sum())
    return out


def _by_name(got):
    return {key[2][0]: e for key, e in got["input_errors"].items()}


def test_layer_pick_prices_joint_rows_evenly_strided_over_the_sample():
    """The errors are priced on ``JOINT_ROWS`` rows of the sample, row ``floor(i * n /
    JOINT_ROWS)`` of its ``n`` (module doc, ``spread_rows``), not on all of them."""
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 6), torch.randn(3 * JOINT_ROWS + 7, 8)
    w = linear.weight.detach()
    weights, inputs = _candidates(w, x)
    got = _pick(weights, inputs, x, linear=linear)
    rows = x[torch.arange(JOINT_ROWS) * x.shape[0] // JOINT_ROWS]
    want = _errors(rows, w, got["weight"], inputs)
    assert _by_name(got).keys() == want.keys()
    for name, e in _by_name(got).items():
        assert e == pytest.approx(want[name], rel=1e-6)


def test_layer_pick_runs_one_round_of_the_descent(fixed_qdq, monkeypatch):
    """The session's descent is one round (the weight given min-max inputs, then the input
    given it): with the candidates a second round would move (see the rounds test), the
    weight stays the first round's."""
    def no_search(*args):
        raise ValueError("not searched")  # as for a layout the weighted search cannot take

    monkeypatch.setattr(layer_choice, "imatrix_state", no_search)
    linear = nn.Linear(1, 1)
    nn.init.ones_(linear.weight)
    weights = {"minmax": _Fixed("w0", 1.0), "mse": _Fixed("w1", 0.6),
               "percentile": _Fixed("w2", 1 / 1.7)}
    inputs = {"minmax": _Fixed("x0", 1.5), "mse": _Fixed("x1", 1.7)}
    got = _pick(weights, inputs, torch.ones(1, 1), linear=linear)
    assert got["weight"] is weights["mse"] and got["input"] is inputs["mse"]


def test_layer_pick_weighs_each_output_by_the_layers_fisher_weights():
    """``fisher``: each output feature's squared error is weighted by the layer's weights
    (``sum_o c_o ||.||_o^2``); a weight on one output alone prices that output alone."""
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 6), torch.randn(32, 8)
    w = linear.weight.detach()
    weights, inputs = _candidates(w, x)
    c = torch.zeros(6)
    c[4] = 1.0
    got = _pick(weights, inputs, x, fisher={"fc": c}, linear=linear)
    want = _errors(x, w, got["weight"], inputs, c)
    for name, e in _by_name(got).items():
        assert e == pytest.approx(want[name], rel=1e-6)


def test_layer_pick_on_a_run_time_input_returns_no_input_state_nor_input_errors():
    """A run-time input (``dynamic=True``) has no candidates: ``"input"`` is None and no
    input error is reported; the weight is still chosen against its run-time QDQ."""
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 6), torch.randn(32, 8)
    weights, _ = _candidates(linear.weight.detach(), x)
    xcfg = Role(QuantSpec("int8", Token()), "minmax", dynamic=True)
    got = _pick(weights, {}, x, xcfg=xcfg, linear=linear)
    assert got["input"] is None and got["input_errors"] == {}
    assert got["weight"] is not weights["minmax"]  # 100x too coarse


def test_layer_pick_keeps_a_single_weight_candidate_without_the_imatrix_search():
    """With one weight candidate there is nothing to choose: no ``imatrix`` candidate is
    added, the weight is that one, however coarse."""
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 6), torch.randn(32, 8)
    weights, inputs = _candidates(linear.weight.detach(), x)
    got = _pick({"minmax": weights["minmax"]}, inputs, x, linear=linear)
    assert got["weight"] is weights["minmax"]


def test_layer_pick_leaves_a_local_dynamic_weight_to_the_session():
    """Only a static weight (``dynamic=False``) is chosen here: a ``"local"`` one (block
    scales at run time) gets None."""
    torch.manual_seed(0)
    linear, x = nn.Linear(32, 6), torch.randn(32, 32)
    weights, inputs = _candidates(linear.weight.detach(), x)
    wcfg = Role(NVFP4, "auto", dynamic="local")
    assert _pick(weights, inputs, x, wcfg=wcfg, linear=linear) is None


@pytest.mark.parametrize("metric", ["joint", "fisher"])
def test_layer_pick_without_an_input_sample_warns_only_where_there_is_a_choice(metric):
    """No input sample: None, and the fallback to the weight's own error is said (naming the
    metric asked for) where the weight has candidates to choose from, not for one."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 6)
    weights, inputs = _candidates(linear.weight.detach(), torch.randn(4, 8))
    fisher = None if metric == "joint" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _pick({"minmax": weights["minmax"]}, inputs, None, fisher, linear=linear) is None
    with pytest.warns(UserWarning, match=rf"auto metric '{metric}' prices a weight .* layer "
                                         r"'fc' has none \(its input saw no tokens\)"):
        assert _pick(weights, inputs, None, fisher, linear=linear) is None
