"""calibrate with ``observer="imatrix_mse"`` gathers each weight's input importance (s30).

The native ``imatrix_mse`` weighs a weight's input channels by their mean ``x^2`` over the
calibration activations; before, calibrate passed none and ran the unweighted search
(bitwise ``memoryless_mse``), silently.
"""

import warnings

import pytest
import torch
from torch import nn

from quantscope.calibration import calibrate, calibrate_many
from quantscope.calibration.recipe import Recipe, Role, Rule, preset
from quantscope.calibration.results.io import load
from quantscope.observers.imatrix import IMatrixMSEObserver


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 32)).eval()


def _batches(n=4, rows=16, three_d=False):
    g = torch.Generator().manual_seed(1)
    shape = (2, rows // 2, 128) if three_d else (rows, 128)
    # channel scales far apart: the weighted search must differ from the unweighted one
    return [torch.randn(*shape, generator=g) * torch.linspace(0.01, 20, 128) for _ in range(n)]


def _layer_inputs(model, batches):
    """Each Linear's inputs over the batches, captured by plain hooks."""
    seen, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.setdefault(name, []).append(args[0])))
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in handles:
        h.remove()
    return seen


def _mean_sq(xs) -> torch.Tensor:
    """Brute force: float64 mean of x^2 per input channel over all rows of all batches."""
    rows = torch.cat([x.detach().double().reshape(-1, x.shape[-1]) for x in xs])
    return rows.square().mean(0).float()


def _weighted_scale(module, spec, importance):
    obs = IMatrixMSEObserver(spec, importance=importance)
    obs(module.weight.detach())
    return obs.calculate_qparams().scale


@pytest.mark.parametrize("three_d", [False, True])
def test_weights_are_searched_with_the_inputs_mean_square(three_d):
    model, batches = _model(), _batches(three_d=three_d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer saw its input: no fallback warning
        c = calibrate(model, batches, "w4a16", observer="imatrix_mse", progress=False)
    assert "imatrix_unweighted" not in c.info
    inputs = _layer_inputs(model, batches)
    modules = dict(model.named_modules())
    for layer in ("0", "2"):
        st = c.states[layer]["weight"]
        assert st.observer == "imatrix_mse"
        want = _weighted_scale(modules[layer], st.spec, _mean_sq(inputs[layer]))
        assert torch.equal(st.qparams.scale, want.reshape(st.qparams.scale.shape))


def test_differs_from_the_unweighted_search():
    model, batches = _model(), _batches()
    c_im = calibrate(model, batches, "w4a16", observer="imatrix_mse", progress=False)
    c_mse = calibrate(model, batches, "w4a16", observer="memoryless_mse", progress=False)
    for layer in ("0", "2"):
        assert not torch.equal(c_im.states[layer]["weight"].qparams.scale,
                               c_mse.states[layer]["weight"].qparams.scale)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _model()
        self.unused = nn.Linear(128, 16)  # never called by forward

    def forward(self, x):
        return self.body(x)


def test_never_called_layer_falls_back_with_one_warning_and_info(tmp_path):
    model, batches = _WithUnused().eval(), _batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = calibrate(model, batches, "w4a16", observer="imatrix_mse", progress=False)
    ours = [w for w in caught if "imatrix_mse" in str(w.message)]
    assert len(ours) == 1 and "'unused'" in str(ours[0].message)
    assert [f["layer"] for f in c.info["imatrix_unweighted"]] == ["unused"]
    assert load(c.save(tmp_path / "cal")).info["imatrix_unweighted"] == \
        c.info["imatrix_unweighted"]
    # its weight: the unweighted search (no importance: uniform)
    st = c.states["unused"]["weight"]
    want = _weighted_scale(model.unused, st.spec, None)
    assert torch.equal(st.qparams.scale, want.reshape(st.qparams.scale.shape))
    # the called layers are still weighted
    inputs = _layer_inputs(model, batches)
    want = _weighted_scale(model.body[0], st.spec, _mean_sq(inputs["body.0"]))
    got = c.states["body.0"]["weight"].qparams.scale
    assert torch.equal(got, want.reshape(got.shape))


def test_users_importance_wins():
    model, batches = _model(), _batches()
    spec = preset("w4a16").rules[0].weight.spec
    mine = tuple(float(v) for v in torch.linspace(5.0, 0.1, 128))
    recipe = Recipe((Rule(weight=Role(spec, "imatrix_mse",
                                      options={"importance": mine})),), ignore=("2",))
    c = calibrate(model, batches, recipe, progress=False)
    want = _weighted_scale(model[0], spec, torch.tensor(mine))
    got = c.states["0"]["weight"].qparams.scale
    assert torch.equal(got, want.reshape(got.shape))
    assert "imatrix_unweighted" not in c.info


def test_calibrate_many_shares_the_gathering():
    model, batches = _model(), _batches()
    got = calibrate_many(model, batches, {"a": preset("w4a16", "imatrix_mse"),
                                          "b": preset("w4a16", "memoryless_mse")},
                         progress=False)
    single = calibrate(model, batches, "w4a16", observer="imatrix_mse", progress=False)
    for layer in ("0", "2"):
        assert torch.equal(got["a"].states[layer]["weight"].qparams.scale,
                           single.states[layer]["weight"].qparams.scale)


def test_round_trips_save_and_load(tmp_path):
    model, batches = _model(), _batches()
    c = calibrate(model, batches, "w4a16", observer="imatrix_mse", progress=False)
    back = load(c.save(tmp_path / "cal"))
    for layer in ("0", "2"):
        assert torch.equal(back.states[layer]["weight"].qparams.scale,
                           c.states[layer]["weight"].qparams.scale)
        assert back.states[layer]["weight"].observer == "imatrix_mse"


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(128, 128)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(128, 8)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x)


def test_sequential_gathers_as_the_whole_model_pass():
    torch.manual_seed(0)
    model, batches = _Blocks().eval(), _batches()
    whole = calibrate(model, batches, "w4a16", observer="imatrix_mse", progress=False)
    seq = calibrate(model, batches, "w4a16", observer="imatrix_mse", progress=False,
                    sequential=True)
    inputs = _layer_inputs(model, batches)
    modules = dict(model.named_modules())
    for layer in ("layers.0.lin", "layers.1.lin", "head"):
        st = seq.states[layer]["weight"]
        want = _weighted_scale(modules[layer], st.spec, _mean_sq(inputs[layer]))
        assert torch.equal(st.qparams.scale, want.reshape(st.qparams.scale.shape))
        assert torch.equal(st.qparams.scale, whole.states[layer]["weight"].qparams.scale)


def _distributed(r, out):
    from quantscope.calibration import Runtime

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = calibrate(_model(), _batches(), "w4a16", observer="imatrix_mse", progress=False,
                      runtime=Runtime(distributed=True))
    out["unweighted"] = c.info.get("imatrix_unweighted")
    out["warned"] = sum("imatrix_mse" in str(w.message) for w in caught)
    out["scales"] = {layer: c.states[layer]["weight"].qparams.scale.tolist()
                     for layer in ("0", "2")}


@pytest.mark.dist
def test_distributed_gathers_every_ranks_importance():
    """Two ranks, the batches sharded: each weight searched with the importance of all the
    batches' rows, as one process over all of them (the sums reduced in float64)."""
    from ports import rank_results, spawn_ranks

    ranks = spawn_ranks(_distributed, 2, 20)
    assert rank_results(ranks, "unweighted") == [None, None]
    assert rank_results(ranks, "warned") == [0, 0]
    single = calibrate(_model(), _batches(), "w4a16", observer="imatrix_mse", progress=False)
    want = {layer: single.states[layer]["weight"].qparams.scale.tolist() for layer in ("0", "2")}
    assert rank_results(ranks, "scales") == [want, want]


def test_fused_shared_weight_scale_keeps_the_importance():
    """q/k/v under a recipe whose runtime shares one weight scale (fp8 per tensor) are
    searched joined, with their one input's importance (they were searched unweighted)."""
    pytest.importorskip("transformers")
    import tiny_models

    from quantscope import presets
    from quantscope.calibration.structure.fusion import join_weights
    from quantscope.layout import Tensor
    from quantscope.spec import QuantSpec

    model, batches = tiny_models.llama(0)
    recipe = Recipe((Rule(("Linear",), weight=Role(presets.FP8_PER_TENSOR, "imatrix_mse"),
                          input=Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")),),
                    ignore=("lm_head",), name="fp8t-imatrix")
    c = calibrate(model, batches, recipe, progress=False)
    attn = model.model.layers[0].self_attn
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    x = _layer_inputs(model, [b for b in batches])[names[0]]
    obs = IMatrixMSEObserver(presets.FP8_PER_TENSOR, importance=_mean_sq(x))
    obs(join_weights([attn.q_proj, attn.k_proj, attn.v_proj]))
    plain = IMatrixMSEObserver(presets.FP8_PER_TENSOR)
    plain(join_weights([attn.q_proj, attn.k_proj, attn.v_proj]))
    want = obs.calculate_qparams().scale
    assert not torch.equal(want, plain.calculate_qparams().scale)  # importance matters here
    for name in names:
        assert torch.equal(c.states[name]["weight"].qparams.scale.reshape(-1), want.reshape(-1))
