"""Session 36's probe of the sensitivity ranking and the float fallback: a conv recognised by
its module (not its weight state), tensors whose layer never runs named, rows sampled over
the whole batch, imatrix importance under ``non_finite="ignore"``, the batches / ``top`` /
``loss`` / ``evaluate`` arguments checked, KV-cache roles kept out of ``keep_float``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration.choice.importance import InputImportance, imatrix_config
from quantscope.calibration.choice.sensitivity import (
    Sensitivity,
    _sample,
    fallback_curve,
    keep_float,
    layer_sensitivity,
    measure,
)
from quantscope.calibration.recipe import Recipe, Rule, preset
from quantscope.calibration.results.apply import qdq_tensor

KW = {"progress": False}


def _calibrate(model, batches, recipe="w8a8"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantscope.calibrate(model, batches, recipe, **KW)


def _linear():
    torch.manual_seed(0)
    model, xs = nn.Sequential(nn.Linear(16, 8)).eval(), [torch.randn(8, 16)]
    return model, xs, _calibrate(model, xs)


# ------------------------------------------------------------------- D1: a conv by its module


def _input_only_convs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    xs = [torch.randn(2, 3, 10, 10) for _ in range(2)]
    rec = Recipe((Rule(("Conv2d",), input=preset("w8a8").rules[0].input),))  # no weight role
    return model, xs, _calibrate(model, xs, rec)


@pytest.mark.parametrize("rank", [layer_sensitivity, measure])
def test_dynamic_fallback_of_an_input_only_conv_stays_float_with_a_warning(rank):
    model, xs, calib = _input_only_convs()
    sens = rank(model, xs, calib)
    with pytest.warns(UserWarning, match="is a convolution's.*kept in float"):
        kept = keep_float(calib, sens, 2, mode="dynamic")
    assert kept.states == {}  # both float: no per-token state on [N, C, H, W]
    assert sens.info["convolutions"] == ["0", "2"]  # read from the model, not a weight state


def test_a_linear_input_still_goes_dynamic_per_token():
    model, xs, calib = _linear()
    kept = keep_float(calib, layer_sensitivity(model, xs, calib), 1, mode="dynamic")
    st = kept.states["0"]["input"]
    assert st.dynamic is True and type(st.spec.layout).__name__ == "Token"


# ---------------------------------------------------------- D2: a layer that never runs named


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.mha(x, x, x)[0])


def test_layer_sensitivity_names_the_tensors_whose_layer_never_runs():
    torch.manual_seed(0)
    model, xs = _Attention().eval(), [torch.randn(2, 5, 16) for _ in range(2)]
    calib = _calibrate(model, xs)
    assert "weight" in calib.states["mha.out_proj"]
    with pytest.warns(UserWarning, match=r"1 calibrated tensor\(s\) not ranked.*"
                                         r"'mha.out_proj' weight.*quantscope.sensitivity"):
        sens = layer_sensitivity(model, xs, calib)
    assert ("mha.out_proj", "weight") not in sens.top(10)  # no error value made up
    assert ("mha.out_proj", "weight") in measure(model, xs, calib).top(10)


def test_batches_of_zero_rows_are_named_as_such_by_both_rankings():
    # probe s59: 0-row tensor batches were said to have all-0 attention masks (sensitivity)
    # and layers whose forward never ran (layer_sensitivity); a model returning None was
    # refused as "auto:" under sensitivity
    model, xs, calib = _linear()
    empty = [torch.zeros(0, 16)]
    with pytest.raises(ValueError, match=r"^sensitivity: .*no real token \(batches of 0 rows"):
        quantscope.sensitivity(model, empty, calibration=calib)
    with pytest.warns(UserWarning, match=r"not ranked: their layer saw no row of batches "
                                         r"\(batches of 0 rows"):
        assert layer_sensitivity(model, empty, calib).rows == []

    class _NoOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 8)

        def forward(self, x):
            self.lin(x)

    with pytest.raises(TypeError, match=r"^cannot compare model outputs of type NoneType "
                                        r"\(auto's and sensitivity's"):
        quantscope.sensitivity(_NoOutput(), xs, "w8a8", **KW)


def test_no_warning_where_every_layer_runs():
    model, xs, calib = _linear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(layer_sensitivity(model, xs, calib).rows) == 2


# ---------------------------------------------------------- D3: rows spread over the batch


@pytest.mark.parametrize("rows", [257, 300, 511, 512, 513, 1000])
def test_sampled_rows_reach_the_end_of_the_batch(rows):
    got = _sample(torch.arange(rows))
    assert len(got) <= 256 and int(got[-1]) >= rows - (rows + 255) // 256  # the last stride


def test_late_rows_count_in_the_layer_error():
    model, _, calib = _linear()
    torch.manual_seed(1)
    x = torch.randn(511, 16) * 0.01
    x[300:] = torch.randn(211, 16) * 5  # only the late rows are large
    w, st = model[0].weight.detach(), calib.states["0"]["input"]
    kept = x[::2]  # every 2nd row of 511: 256 rows over the whole batch
    want = float(((qdq_tensor(kept, st) - kept) @ w.T).double().square().sum()
                 / (kept @ w.T).double().square().sum())
    row = next(r for r in layer_sensitivity(model, [x], calib).rows if r["role"] == "input")
    assert row["divergence"] == pytest.approx(want, rel=1e-4)


# ------------------------------------------------ D4: imatrix importance and non_finite


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    return model, [torch.randn(8, 16) * 3 for _ in range(4)]


def test_one_inf_under_ignore_keeps_the_imatrix_weight_candidate():
    model, xs = _mlp()
    xs[3][2, 3] = float("inf")
    calib = _calibrate(model, xs, preset("w8a8", "auto", non_finite="ignore"))
    assert "weight=imatrix" in calib.info["auto"]["role_scores"]


def test_importance_reads_non_finite_as_zero_where_ignored():
    model, _ = _mlp()
    x = torch.randn(4, 16)
    bad = x.clone()
    bad[1, 3] = float("inf")
    bad[2, 5] = float("nan")
    zeroed = bad.nan_to_num(0.0, 0.0, 0.0)
    imp = InputImportance(model, ["0"], ignore={"0"})
    with imp.counting():
        model(bad)
    want = zeroed.square().mean(0)
    assert torch.allclose(imp.means()["0"], want)
    plain = InputImportance(model, ["0"])
    with plain.counting():
        model(bad)
    assert not torch.isfinite(plain.means()["0"]).all()  # "error": not hidden here


def test_non_finite_importance_is_said_not_swallowed():
    model, xs = _mlp()
    calib = _calibrate(model, xs[:1], preset("w8a8", "mse"))
    imp = {"0": torch.full((16,), float("inf")), "2": torch.ones(32)}
    with pytest.warns(UserWarning, match=r"layer '0'.*finite.*no imatrix weight candidate"):
        out = imatrix_config(model, calib, imp)
    assert out.states["0"]["weight"].observer != "imatrix"
    assert out.states["2"]["weight"].observer == "imatrix"


# --------------------------------------------------------- D5: batches checked up front


@pytest.mark.parametrize("rank", [layer_sensitivity, measure])
@pytest.mark.parametrize("one", ["tensor", "dict"])
def test_one_batch_instead_of_batches_is_refused(rank, one):
    model, xs, calib = _linear()
    batch = xs[0] if one == "tensor" else {"input": xs[0]}
    with pytest.raises(TypeError, match="batches must be an iterable of batches.*wrap it"):
        rank(model, batch, calib)


# ------------------------------------------------------------------ D6: top's arguments


def test_top_checks_n_and_role():
    model, xs, calib = _linear()
    sens = measure(model, xs, calib)
    for n in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match=r"Sensitivity.top: n must be a non-negative "):
            sens.top(n)
    with pytest.raises(ValueError, match=r"role must be None or one of .*'weight'.*"
                                         r"this ranking's: \['input', 'weight'\].*'inputs'"):
        sens.top(5, "inputs")
    assert sens.top(5, "output") == [] and len(sens.top(5)) == 2 and sens.top(0) == []


def test_plot_checks_top(tmp_path):
    """plot(top=-1) silently dropped the least sensitive row, as top(-1) did."""
    pytest.importorskip("matplotlib")
    model, xs, calib = _linear()
    sens = measure(model, xs, calib)
    for top in (-1, 2.0):
        with pytest.raises(ValueError, match=r"Sensitivity.plot: top must be a non-negative"):
            sens.plot(tmp_path / "s.png", top=top)
    assert not (tmp_path / "s.png").exists()


# ------------------------------------------------------------- D7: the KV cache's roles


def test_keep_float_passes_over_kv_cache_roles_and_the_result_exports(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from tiny_models import llama

    model, batches = llama()
    calib = _calibrate(model, batches, preset("w8a8", kv_cache="fp8"))
    sens = measure(model, batches[:1], calib, roles=("value", "input"))
    assert sens.top(1, "value")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = keep_float(calib, sens, 1, mode="float")
    (tensor,) = kept.info["keep_float"]["tensors"]
    assert tensor.endswith(" input")
    for layer, rs in calib.states.items():  # every KV pair kept whole
        if "value" in rs:
            assert {"key", "value"} <= set(kept.states[layer]), layer
    with pytest.warns(UserWarning, match="0 kept float.*KV cache's key / value"):
        keep_float(calib, Sensitivity([r for r in sens.rows if r["role"] == "value"]), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantscope.export(kept, model, tmp_path / "out")


# --------------------------------------------------------------------- D8: a custom loss


@pytest.mark.parametrize("loss, error, match", [
    (lambda o, r, b: float("nan"), ValueError,
     "loss returned nan on batch 0.*outputs are finite; loss must return a finite scalar"),
    (lambda o, r, b: (o - r).square().mean(0), TypeError,
     r"loss must return a finite scalar .*got a tensor of shape \(8,\) on batch 0"),
    (lambda o, r, b: None, TypeError, "loss must return a finite scalar .*got NoneType"),
])
def test_a_custom_loss_that_is_no_finite_scalar_is_named(loss, error, match):
    model, xs, calib = _linear()
    with pytest.raises(error, match=match):
        measure(model, xs, calib, loss=loss)


def test_a_one_element_tensor_loss_is_taken():
    model, xs, calib = _linear()
    sens = measure(model, xs, calib, loss=lambda o, r, b: (o - r).square().mean())
    assert all(r["divergence"] > 0 for r in sens.rows)


# ------------------------------------------------------------------------------ minor


def test_markdown_row_of_a_name_with_a_line_break_stays_one_row():
    sens = Sensitivity([{"rank": 1, "layer": "a\nb|c", "role": "input", "observer": "minmax",
                         "divergence": 0.5}])
    table = sens.to_markdown().strip().splitlines()
    assert table[-1] == "| 1 | a\\nb\\|c | input | minmax | 0.5 |"


def test_fallback_curve_names_evaluate():
    model, xs, calib = _linear()
    sens = layer_sensitivity(model, xs, calib)
    with pytest.warns(UserWarning, match=r"fallback_curve: evaluate returned nan for n=0"):
        rows = fallback_curve(model, calib, sens, lambda m: float("nan"), ns=(0,))
    assert "NaN" in json.dumps(rows)  # kept, as said
    with pytest.raises(TypeError, match=r"fallback_curve: evaluate must return a finite "
                                        r"scalar .*got NoneType for n=0"):
        fallback_curve(model, calib, sens, lambda m: None, ns=(0,))
    rows = fallback_curve(model, calib, sens, lambda m: torch.tensor(2.0), ns=(0, 1))
    assert [r["quality"] for r in rows] == [2.0, 2.0]
