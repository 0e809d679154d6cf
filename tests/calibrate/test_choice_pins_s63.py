"""Pins from the s63 mutation round over ``calibration/choice`` (SmoothQuant and its channel
ranges, the per-layer ``joint`` criterion): behaviour no earlier test held, each checked
against its definition (the module docs' formulas, llm-compressor's constant)."""

import torch
from test_smooth_dataflow import _Norm  # x * weight: a norm SmoothQuant may scale
from torch import nn

from quantscope import QuantSpec, qparams_from_range
from quantscope.calibration.choice.layer_choice import joint_choice
from quantscope.calibration.choice.smooth import find_mappings, restore, smooth, smoothing_scales
from quantscope.calibration.choice.smooth_ranges import channel_ranges
from quantscope.calibration.results.role_state import RoleState
from quantscope.layout import Channel, Tensor


class _MLP(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden)
        self.up_proj = nn.Linear(width, hidden)
        self.down_proj = nn.Linear(hidden, width)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A decoder layer's MLP half: ``post_attention_layernorm`` into gate / up, and up into
    down (two of :data:`MAPPINGS`, which share ``up_proj.weight``)."""

    def __init__(self, width=8, hidden=16):
        super().__init__()
        self.post_attention_layernorm = _Norm(width)
        self.mlp = _MLP(width, hidden)

    def forward(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


def _layer_and_batches(seed=0):
    torch.manual_seed(seed)
    model = _Layer().eval()
    g = torch.Generator().manual_seed(seed + 1)
    return model, [torch.randn(3, 8, generator=g) * 4 for _ in range(2)]


def test_channel_ranges_span_every_batch():
    """``range_j = max - min`` of channel ``j`` of the balanced layers' input *over the
    batches given* (smooth's doc): the min of one batch and the max of another both count."""
    model, batches = _layer_and_batches()
    batches[1] = batches[1] + 50.0  # the second batch holds every channel's max
    mappings = find_mappings(model)
    assert [m.previous for m in mappings] == ["post_attention_layernorm", "mlp.up_proj"]
    with torch.no_grad():
        normed = torch.cat([model.post_attention_layernorm(x) for x in batches])
        mlp = model.mlp
        hidden = torch.cat([torch.relu(mlp.gate_proj(y)) * mlp.up_proj(y)
                            for y in map(model.post_attention_layernorm, batches)])
    got = channel_ranges(model, batches, mappings)
    assert torch.equal(got["post_attention_layernorm"], normed.amax(0) - normed.amin(0))
    assert torch.equal(got["mlp.up_proj"], hidden.amax(0) - hidden.amin(0))


def test_a_mapping_that_saw_nan_is_skipped_for_that_reason():
    """smooth's doc: a mapping is skipped when it never ran or saw NaN / inf, and
    ``info["why"]`` says why; the model is left as it was."""
    model, batches = _layer_and_batches()
    batches[0][1, 2] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    info = smooth(model, batches, 0.5)
    assert info["smoothed"] == []
    assert info["why"] == {"post_attention_layernorm": "saw NaN or inf",
                           "mlp.up_proj": "saw NaN or inf"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_restore_undoes_a_weight_two_mappings_scale():
    """``originals`` receives every parameter *before it is changed* and :func:`restore`
    undoes smooth exactly: ``up_proj.weight`` is scaled by column (the norm's mapping) and
    then by row (its own into ``down_proj``); it must come back to its first value, not
    the one between the two mappings."""
    model, batches = _layer_and_batches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    originals = {}
    info = smooth(model, batches, 0.5, originals=originals)
    assert info["smoothed"] == ["post_attention_layernorm", "mlp.up_proj"]
    assert not torch.equal(model.mlp.up_proj.weight, before["mlp.up_proj.weight"])
    restore(model, originals)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_silent_channels_scale_is_llm_compressors_minimum():
    """A channel whose activation range is 0 gets ``s = 0 ** alpha / ... = 0``, raised to
    llm-compressor's ``MINIMUM_SMOOTHING_SCALE`` (1e-5 in its
    ``modifiers/transform/smoothquant/base.py``), so that a recipe moved over smooths
    alike; a channel above it keeps the formula's value."""
    ranges = torch.tensor([0.0, 4.0])
    weights = [torch.tensor([[1.0, 0.5], [-2.0, 0.25]])]
    s = smoothing_scales(ranges, weights, 0.5)
    assert s[0] == torch.tensor(1e-5, dtype=torch.float32)
    # column 1: 4 ** 0.5 / (2 * 0.5) ** 0.5 = 2
    assert s[1] == torch.tensor(2.0)


def test_joint_choice_keeps_the_first_of_two_equal_weight_candidates():
    """The descent starts from the first candidate of each list (min-max by convention) and
    ties keep it (``_states``' doc): two weight states that quantize alike price alike, and
    the first is chosen."""
    torch.manual_seed(0)
    w, x = torch.randn(6, 8), torch.randn(16, 8)
    spec = QuantSpec("int8", Channel(0))
    amax = w.abs().amax(1)
    qp = qparams_from_range(-amax, amax, spec)
    first = RoleState(spec, "minmax", "minmax", qparams=qp, shape=(6, 8))
    second = RoleState(spec, "mse", "mse", qparams=qp, shape=(6, 8))
    inp = RoleState(QuantSpec("int8", Tensor()), "memoryless_minmax", "memoryless_minmax",
                    dynamic=True)
    i, j, err = joint_choice(x, w, [first, second], [inp])
    assert (i, j) == (0, 0) and err > 0


def test_the_joint_descent_gets_min_max_first_whatever_the_candidates_order():
    """``joint`` starts its descent from the first candidate of each list, and ties keep it:
    that one is min-max by convention (``_states`` puts it first), so an ``Auto`` whose
    candidates name ``mse`` before ``minmax`` still starts from min-max."""
    from types import SimpleNamespace

    from quantscope.calibration import Role
    from quantscope.calibration.choice.layer_choice import _states
    from quantscope.calibration.run.observe import observer_key

    cfg = Role(QuantSpec("int8", Channel(0)), "auto")
    names = ["mse", "percentile", "minmax"]
    slots = {("fc", "weight"): SimpleNamespace(
        observers={observer_key(n, cfg): n for n in names})}

    def state_of(observer, role_cfg, key, shape):
        return RoleState(role_cfg.spec, observer, "auto")

    got = _states("fc", slots, state_of, "weight", cfg, names, None)
    assert [st.observer for _, st in got] == ["minmax", "mse", "percentile"]


def _per_tensor(spec, amax, observer):
    amax = torch.tensor([float(amax)])
    return RoleState(spec, observer, "auto", qparams=qparams_from_range(-amax, amax, spec))


def test_layer_pick_reports_the_input_errors_under_the_weight_it_picked():
    """``input_errors`` is ``{key: error}`` of every input candidate under the *picked*
    weight (layer_pick's doc; a fusion group's one input is then the least total over its
    members): each is ``||X W^T - Q_b(X) Q_i(W)^T||^2`` with ``i`` the chosen weight, here
    not the first candidate (a min-max weight state made 100x too coarse)."""
    from types import SimpleNamespace

    from quantscope.calibration import Role
    from quantscope.calibration.choice.layer_choice import layer_pick
    from quantscope.calibration.run.observe import observer_key
    from quantscope.observers.runtime import qdq_tensor

    torch.manual_seed(0)
    linear, x = nn.Linear(8, 6), torch.randn(32, 8)
    w = linear.weight.detach()
    spec = QuantSpec("int8", Tensor())
    wcfg, xcfg = Role(spec, "auto"), Role(spec, "auto")
    amax_w, amax_x = float(w.abs().max()), float(x.abs().max())
    weights = {"minmax": _per_tensor(spec, 100 * amax_w, "minmax"),
               "mse": _per_tensor(spec, amax_w, "mse")}
    inputs = {"minmax": _per_tensor(spec, amax_x, "minmax"),
              "percentile": _per_tensor(spec, amax_x / 2, "percentile")}
    slots = {("fc", "weight"): SimpleNamespace(
                 module=linear, observers={observer_key(n, wcfg): st for n, st in weights.items()}),
             ("fc", "input"): SimpleNamespace(
                 observers={observer_key(n, xcfg): st for n, st in inputs.items()})}
    plan = {("fc", "weight"): (wcfg, list(weights)), ("fc", "input"): (xcfg, list(inputs))}

    def state_of(observer, cfg, key, shape):
        return observer

    got = layer_pick("fc", plan, slots, {("fc", "input"): x}, state_of)
    assert got["weight"] is not weights["minmax"]
    wq, ref = qdq_tensor(w, got["weight"]), x @ w.T
    want = {name: float((qdq_tensor(x, st) @ wq.T - ref).square().double().sum())
            for name, st in inputs.items()}
    errors = {key[2][0]: e for key, e in got["input_errors"].items()}
    assert errors.keys() == want.keys()
    for name, e in errors.items():
        assert abs(e - want[name]) <= 1e-6 * want[name]
