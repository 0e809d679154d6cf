"""Probe fixes (s29) of auto's output-aware choice: joint on run-time inputs, refused
candidates, fallback_curve after a fallback, all-zero outputs, non_finite='ignore'."""

import warnings

import pytest
import torch

import quantscope
from quantscope.calibration import Auto
from quantscope.calibration.choice.auto import _divergence
from quantscope.calibration.choice.layer_choice import imatrix_state
from quantscope.calibration.choice.sensitivity import fallback_curve
from quantscope.calibration.recipe import preset
from quantscope.calibration.results.apply import qdq_tensor


def _mlp(inp=128, hid=128, out=32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inp, hid), torch.nn.ReLU(),
                               torch.nn.Linear(hid, out)).eval()


def test_joint_on_a_dynamic_input_prices_weights_against_its_run_time_qdq():
    m = _mlp()
    b = [torch.randn(16, 128) * torch.linspace(0.1, 4, 128) for _ in range(3)]
    x, w = torch.cat(b), m[0].weight.detach()
    c = quantscope.calibrate(m, b, "w8a8-dynamic", observer="auto", auto=Auto(metric="joint"),
                             progress=False)
    single = {n: quantscope.calibrate(m, b, "w8a8-dynamic", observer=n, progress=False)
              for n in ("minmax", "mse")}
    cands = [single[n].states["0"]["weight"] for n in ("minmax", "mse")]
    cands.append(imatrix_state(w, x.square().mean(0), cands[0]))
    xq = qdq_tensor(x, c.states["0"]["input"]).double()  # per token, as apply() runs it
    ref = x.double() @ w.double().T

    def err(s):
        return float((xq @ qdq_tensor(w, s).double().T - ref).square().sum())

    best = min(cands, key=err)
    got = c.states["0"]["weight"]
    assert got.observer == best.observer
    assert err(got) == pytest.approx(err(best), rel=1e-9)
    assert c.states["0"]["input"].dynamic is True


def test_joint_on_a_weight_only_recipe_says_it_falls_back_to_tensor_once():
    m = _mlp()
    b = [torch.randn(8, 128) for _ in range(2)]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = quantscope.calibrate(m, b, "w4a16", observer="auto", auto=Auto(metric="joint"),
                                 progress=False)
    said = [str(x.message) for x in got if "'joint'" in str(x.message)]
    assert len(said) == 1 and "weight-only" in said[0] and "'tensor'" in said[0]
    t = quantscope.calibrate(m, b, "w4a16", observer="auto", auto=Auto(metric="tensor"),
                             progress=False)
    for layer in ("0", "2"):
        assert c.states[layer]["weight"].quantizes_like(t.states[layer]["weight"])


def test_model_metric_drops_a_candidate_a_role_refuses():
    m = _mlp()
    b = [torch.randn(8, 128) for _ in range(3)]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = quantscope.calibrate(m, b, "w4a16-asym", observer="auto",
                                 auto=Auto(candidates=("minmax", "linear_mse")), progress=False)
    assert set(c.info["auto"]["refused"]) == {"linear_mse"}
    assert "symmetric" in c.info["auto"]["refused"]["linear_mse"]
    assert list(c.info["auto"]["scores"]) == ["minmax"]
    assert any("linear_mse" in str(x.message) for x in got)
    alone = quantscope.calibrate(m, b, "w4a16-asym", observer="minmax", progress=False)
    assert c.states["0"]["weight"].quantizes_like(alone.states["0"]["weight"])
    with pytest.raises(ValueError, match="no candidate left.*linear_mse"):
        quantscope.calibrate(m, b, "w4a16-asym", observer="auto",
                             auto=Auto(candidates=("linear_mse",)), progress=False)


@pytest.mark.parametrize("name,why", [("torch.ao:MinMaxObserver", "a compat class"),
                                      ("nosuch", "unknown observer")])
def test_auto_candidates_refuse_names_auto_cannot_run(name, why):
    with pytest.raises(ValueError, match=rf"Auto\.candidates names '{name}': {why}.*minmax"):
        Auto(metric="tensor", candidates=("minmax", name))


def test_a_candidate_refused_on_every_layer_is_warned_about():
    m = _mlp()
    b = [torch.randn(8, 128) for _ in range(2)]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = quantscope.calibrate(m, b, "w4a16-asym", observer="auto",
                                 auto=Auto(metric="tensor", candidates=("minmax", "linear_mse")),
                                 progress=False)
    said = [str(x.message) for x in got if "linear_mse" in str(x.message)]
    assert len(said) == 1 and "symmetric" in said[0]
    assert c.states["0"]["weight"].observer == "memoryless_minmax"


def test_fallback_curve_on_a_calibration_with_an_earlier_fallback():
    m = _mlp(32, 64, 16)
    b = [torch.randn(8, 32) for _ in range(2)]
    c = quantscope.calibrate(m, b, "w8a8", progress=False)
    s = quantscope.sensitivity(m, b[:1], calibration=c)
    k1 = quantscope.keep_float(c, s, 1)
    rows = fallback_curve(m, k1, s, lambda mm: 0.0, ns=(0, 1))
    macs = {"0": 64 * 32, "2": 16 * 64}  # weight elements of each layer
    total = sum(macs.values())
    for row in rows:
        layers = {t.split()[0] for t in row["tensors"]}
        assert row["float_macs_pct"] == round(100 * sum(macs[x] for x in layers) / total, 2)
    assert rows[0]["tensors"] == k1.info["keep_float"]["tensors"]
    assert rows[1]["float_macs_pct"] == 100.0


def test_identical_zero_outputs_score_no_divergence():
    z, one = torch.zeros(3, 4, dtype=torch.float64), torch.eye(3, 4, dtype=torch.float64)
    assert _divergence("cos", z, z) == 0.0
    assert _divergence("cos", z, one) == 1.0 and _divergence("cos", one, z) == 1.0
    mixed = torch.cat([z[:1], one[1:]])  # row 0 both zero, rows 1-2 equal unit rows
    assert _divergence("cos", mixed, mixed) == 0.0
    m = _mlp(16, 16, 8)
    m[2].weight.data.zero_()
    m[2].bias.data.zero_()
    b = [torch.randn(4, 16) for _ in range(2)]
    c = quantscope.calibrate(m, b, "w8a8", observer="auto", progress=False)
    assert max(c.info["auto"]["scores"].values()) == 0.0
    s = quantscope.sensitivity(m, b, calibration=c)
    assert max(r["divergence"] for r in s.rows) == 0.0


def test_model_metric_leaves_non_finite_batches_out_under_ignore():
    m = _mlp(16, 16, 8)
    b = [torch.randn(4, 16) for _ in range(3)]
    b[1][0, 0] = float("nan")
    c = quantscope.calibrate(m, b, preset("w8a8", "auto", non_finite="ignore"), progress=False)
    assert c.info["auto"]["non_finite_pieces"] == 1
    assert c.info["auto"]["score_pieces"] == 2  # of 3 scoring batches
    for rs in c.states.values():
        for st in rs.values():
            assert torch.isfinite(st.qparams.scale).all()
    bad = [torch.full((4, 16), float("nan"))]
    with pytest.raises(ValueError, match="every scoring batch"):
        quantscope.calibrate(m, bad, preset("w8a8", "auto", non_finite="ignore"),
                             progress=False)
