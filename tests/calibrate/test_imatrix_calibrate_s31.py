"""``imatrix_mse`` on a transformers Conv1D, and ``auto``'s unweighted candidates (s31).

A Conv1D (GPT-2's ``c_attn`` / ``c_proj`` / ``c_fc``) holds its weight ``[in, out]``: its
importance weighs dim 0. Before, its search fell back to unweighted with a warning. And an
``auto`` role whose ``imatrix_mse`` candidate searched unweighted was missing from
``info["imatrix_unweighted"]`` (and warned about by nothing).
"""

import warnings

import pytest
import torch
from torch import nn

from quantscope import QuantSpec, presets
from quantscope.calibration import calibrate, preset
from quantscope.calibration.options import Auto
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.structure.conv1d import transposed_layout
from quantscope.layout import Block, Channel, Group, Tile
from quantscope.observers.imatrix import IMatrixMSEObserver

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D

NX, NF = 64, 96  # in, out: not square, so a weighted dim mixed up cannot go unseen


def _conv(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Conv1D(NF, NX)).eval()


def _batches(n=3, width=NX):
    g = torch.Generator().manual_seed(1)
    # input channels far apart in scale: the weighted search differs from the unweighted one
    return [torch.randn(2, 8, width, generator=g) * torch.linspace(0.01, 20, width)
            for _ in range(n)]


def _mean_sq(xs) -> torch.Tensor:
    """Brute force: float64 mean of x^2 per input channel over every row."""
    rows = torch.cat([x.detach().double().reshape(-1, x.shape[-1]) for x in xs])
    return rows.square().mean(0).float()


def _inputs(model, kind) -> dict:
    """Each ``kind`` module's inputs over the batches, by plain hooks."""
    seen = {}
    for name, m in model.named_modules():
        if isinstance(m, kind):
            m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.setdefault(name, []).append(args[0]))
    return seen


def _per_element(scale, layout, shape) -> torch.Tensor:
    """Each weight element's scale (the unit's) in the weight's own shape."""
    units = layout.to_units(torch.zeros(shape))
    return layout.to_shape(scale.reshape(-1, 1).expand(units.shape).contiguous(), shape)


def _linear_search(w_linear, spec, importance):
    """The search on the equivalent Linear ``[out, in]``: per-element scales."""
    obs = IMatrixMSEObserver(spec, importance=importance)
    obs(w_linear)
    return _per_element(obs.calculate_qparams().scale, spec.layout, tuple(w_linear.shape))


SPECS = {
    "channel": presets.INT8_PER_CHANNEL,
    "channel:1": QuantSpec("int8", Channel(1)),
    "group": QuantSpec("int4", Group(32)),
    "group:0": QuantSpec("int4", Group(32, 0)),
    "group-asym": QuantSpec("int4", Group(16), symmetric=False),
    "tensor": presets.INT8_PER_TENSOR,
    "fp8-tensor": presets.FP8_PER_TENSOR,
    "nvfp4": presets.NVFP4,
    "mxfp4": presets.MXFP4,
    "block-pad": QuantSpec("int4", Block(40)),  # 64 = 40 + 24: padded blocks
    "tile": QuantSpec("fp8_e4m3", Tile(16, 32)),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_conv1d_weight_is_searched_as_its_linear_twin(name):
    """Every layout a rule can give a Conv1D weight: weighted (no fallback, no warning), bit
    for bit the search on ``W.T`` under the rule's layout with the same importance, the
    scales transposed back; and not the unweighted search."""
    spec = SPECS[name]
    model, batches = _conv(), _batches()
    seen = _inputs(model, Conv1D)
    recipe = Recipe((Rule(("Conv1D",), weight=Role(spec, "imatrix_mse")),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # weighted: no fallback warning
        c = calibrate(model, batches, recipe, progress=False)
    assert "imatrix_unweighted" not in c.info
    st, w = c.states["0"]["weight"], model[0].weight.detach()
    assert st.spec.layout == transposed_layout(spec.layout)
    got = _per_element(st.qparams.scale, st.spec.layout, tuple(w.shape)).T
    want = _linear_search(w.T, spec, _mean_sq(seen["0"]))
    assert torch.equal(got, want)
    if name not in ("channel:1", "group:0"):  # units within one input channel: weights equal
        assert not torch.equal(got, _linear_search(w.T, spec, None))


def test_observer_weighs_the_input_dim():
    """The observer alone, ``input_dim=0`` on ``[in, out]``: each element weighed by its
    input channel (a constant importance per output column would equal the unweighted)."""
    w = _conv()[0].weight.detach()
    spec = QuantSpec("int4", Group(16))
    lay = transposed_layout(spec.layout)
    imp = torch.linspace(0.01, 50, NX)
    obs = IMatrixMSEObserver(QuantSpec("int4", lay), importance=imp, input_dim=0)
    obs(w)
    got = _per_element(obs.calculate_qparams().scale, lay, tuple(w.shape)).T
    assert torch.equal(got, _linear_search(w.T, spec, imp))


@pytest.mark.parametrize("width", [NF, NX])  # NX: a square weight (GPT-2's c_proj)
def test_users_importance_on_a_conv1d_weighs_dim_0(width):
    """A role's own ``importance`` on a Conv1D weighs dim 0, its input channels, with or
    without ``input_dim=0`` (session 33: without it the observer weighed the last dim, the
    outputs: refused where the widths differ, silently wrong on a square weight); an
    explicit ``input_dim=-1`` is the user's and refused for its width."""
    torch.manual_seed(0)
    model, batches = nn.Sequential(Conv1D(width, NX)).eval(), _batches()
    spec = QuantSpec("int4", Group(32))
    mine = tuple(float(v) for v in torch.linspace(5.0, 0.1, NX))
    w = model[0].weight.detach()
    want = _linear_search(w.T, spec, torch.tensor(mine))
    for opts in ({"importance": mine, "input_dim": 0}, {"importance": mine}):
        c = calibrate(model, batches, Recipe((Rule(("Conv1D",), weight=Role(
            spec, "imatrix_mse", options=opts)),)), progress=False)
        st = c.states["0"]["weight"]
        assert torch.equal(_per_element(st.qparams.scale, st.spec.layout, tuple(w.shape)).T,
                           want)
    assert not torch.equal(want, _linear_search(w.T, spec, None))
    if width != NX:
        with pytest.raises(ValueError, match="importance has 64 values, the tensor's last dim"):
            calibrate(model, batches, Recipe((Rule(("Conv1D",), weight=Role(
                spec, "imatrix_mse", options={"importance": mine, "input_dim": -1})),)),
                progress=False)


def test_observer_refuses_an_input_dim_it_cannot_read():
    spec = QuantSpec("int8", Channel(1))
    with pytest.raises(ValueError, match="input_dim must be an integer"):
        IMatrixMSEObserver(spec, input_dim="0")
    with pytest.raises(ValueError, match=r"importance has 96 values, the tensor's input_dim 0"):
        IMatrixMSEObserver(spec, importance=torch.ones(NF), input_dim=0)(torch.randn(NX, NF))
    with pytest.raises(ValueError, match="input_dim 2 is no dim"):
        IMatrixMSEObserver(spec, importance=torch.ones(NX), input_dim=2)(torch.randn(NX, NF))


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=128, n_layer=1, n_head=2, vocab_size=100,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(2)
    return model, [torch.randint(0, 100, (2, 16), generator=g) for _ in range(3)]


def test_gpt2_conv1d_weights_are_weighted():
    """GPT-2's c_attn / c_proj / c_fc under ``w4a16`` (groups of 128 along the input
    features): each the search on its ``W.T`` with its own inputs' mean ``x^2``."""
    model, batches = _gpt2()
    seen = _inputs(model, Conv1D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        c = calibrate(model, batches, preset("w4a16", targets=["Conv1D"]),
                      observer="imatrix_mse", progress=False)
    assert "imatrix_unweighted" not in c.info
    modules = dict(model.named_modules())
    layers = [n for n, m in modules.items() if isinstance(m, Conv1D)]
    assert sorted(c.states) == sorted(layers) and len(layers) == 4
    spec = preset("w4a16").rules[0].weight.spec
    for layer in layers:
        st, w = c.states[layer]["weight"], modules[layer].weight.detach()
        got = _per_element(st.qparams.scale, st.spec.layout, tuple(w.shape)).T
        assert len(seen[layer]) == len(batches)  # the pass's forwards, one per batch
        assert torch.equal(got, _linear_search(w.T, spec, _mean_sq(seen[layer])))


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(NX, 32)
        self.unused = nn.Linear(NX, 16)  # never called by forward

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("metric", ["tensor", "output"])
def test_auto_lists_its_unweighted_imatrix_candidate(metric):
    """``auto`` choosing per role among candidates with ``imatrix_mse``: the layer whose
    input the pass never saw had that candidate searched unweighted (and took it); listed
    and warned about once, as under a role naming ``imatrix_mse``; the called layer not."""
    model, batches = _WithUnused().eval(), _batches()
    recipe = Recipe((Rule(weight=Role(presets.INT8_PER_CHANNEL, "auto")),))
    auto = Auto(metric=metric, candidates=("minmax", "imatrix_mse"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = calibrate(model, batches, recipe, auto=auto, progress=False)
    assert c.states["unused"]["weight"].observer == "imatrix_mse"
    flat = c.info["imatrix_unweighted"]
    assert [f["layer"] for f in flat] == ["unused"]
    ours = [w for w in caught if "imatrix_mse weights searched unweighted" in str(w.message)]
    assert len(ours) == 1 and "'unused'" in str(ours[0].message)
    # the reason: a role naming imatrix_mse's, said to be auto's candidate
    plain = calibrate(model, batches, recipe, observer="imatrix_mse", progress=False)
    assert flat[0]["reason"] == \
        f"auto's candidate imatrix_mse: {plain.info['imatrix_unweighted'][0]['reason']}"
