"""Pins from the s70 mutation round over ``calibration/choice/sensitivity.py``: the cheap
ranking's sums (float64 squares, a zero output ranked 0), its refusals, ranks, ``info``
counts and unranked-tensor warning, an Embedding's input passed over;
``keep_float``'s dynamic state and its silence on a convolution in float mode, an expert's
fused group joining its slot; ``check_fallback`` and a ``ranker`` in place of the batch;
``fallback_curve``'s float share of no static layer and its warning on an inf quality.
Behaviour no earlier test held; expected values come from the docstrings' formulas and
definitions, not from printing what the code returns."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from test_choice_defects import _Emb, _emb_recipe
from test_choice_sensitivity_pins_s64 import _calibrate, _mlp, _rows
from torch import nn

from quantscope.calibration.choice.sensitivity import (
    Sensitivity,
    check_fallback,
    fall_back,
    fallback_curve,
    keep_float,
    layer_sensitivity,
)
from quantscope.observers.runtime import qdq_tensor


def _weight_error(x, model, calib):
    """``||X Q(W)^T - X W^T||^2 / ||X W^T||^2`` of layer ``"0"`` in float64 (the docstring's
    weight row)."""
    w = model[0].weight.detach()
    y = x.double() @ w.double().T
    q = x.double() @ qdq_tensor(w, calib.states["0"]["weight"]).double().T
    return float((q - y).square().sum() / y.square().sum())


def _divergence(sens, layer, role):
    return next(r["divergence"] for r in sens.rows if (r["layer"], r["role"]) == (layer, role))


# ----------------------------------------------------------------- layer_sensitivity


def test_an_output_whose_squares_overflow_float32_is_still_ranked():
    """Outputs near 1e20: their squares (1e40) are past float32 but summed in float64, so
    the layer is ranked by the formula, not refused as not finite."""
    model, _, calib = _mlp()
    x = torch.randn(4, 16) * 1e20
    sens = layer_sensitivity(model, [x], calib, roles=("weight",))
    assert _divergence(sens, "0", "weight") == pytest.approx(
        _weight_error(x, model, calib), rel=1e-4)


def test_an_all_zero_batch_ranks_its_tensors_zero():
    """``||X W^T||^2`` of 0 (all-zero rows): both errors are 0 too, and the rows say 0, not a
    division by zero."""
    model, _, calib = _mlp()
    sens = layer_sensitivity(model, [torch.zeros(3, 16)], calib)
    assert {(r["layer"], r["role"]): r["divergence"] for r in sens.rows if r["layer"] == "0"} \
        == {("0", "weight"): 0.0, ("0", "input"): 0.0}


def test_no_batches_is_refused_naming_layer_sensitivity():
    model, _, calib = _mlp()
    with pytest.raises(ValueError, match=r"^layer_sensitivity: batches is empty$"):
        layer_sensitivity(model, [], calib)


def test_ranks_count_from_one_most_sensitive_first():
    model, xs, calib = _mlp()
    rows = layer_sensitivity(model, xs, calib).rows
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    assert [r["divergence"] for r in rows] == sorted((r["divergence"] for r in rows),
                                                     reverse=True)


def test_info_counts_one_forward_per_batch():
    model, xs, calib = _mlp()
    sens = layer_sensitivity(model, xs + xs[:1], calib)
    assert sens.info["forwards"] == sens.info["batches"] == 3
    assert sens.info["metric"] == "relative layer output error"


def test_an_embeddings_input_state_is_neither_ranked_nor_warned_of():
    """Its input, the token ids, is not ranked: an input state on it is passed over, not
    said to be unranked."""
    torch.manual_seed(0)
    model = _Emb().eval()
    ids = [torch.randint(0, 50, (2, 6))]
    calib = _calibrate(model, ids, _emb_recipe())
    calib = replace(calib, states={**calib.states, "emb": {
        **calib.states["emb"], "input": calib.states["fc"]["input"]}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sens = layer_sensitivity(model, ids, calib.without_fingerprints())
    assert {(r["layer"], r["role"]) for r in sens.rows} == {
        ("emb", "weight"), ("fc", "weight"), ("fc", "input")}


# ------------------------------------------------------------------------- keep_float


def test_a_fused_group_with_an_expert_falls_back_with_the_experts_whole_slot():
    """A shared input group holding an expert's layer joins that expert's slot (every
    expert's gate / up input of the module): one unit of all three."""
    calib = _mlp()[2]
    st = calib.states["0"]["input"]
    names = ["x", "moe.experts.0.up_proj", "moe.experts.1.gate_proj"]
    calib = replace(calib, states={k: {"input": st} for k in names},
                    info={**calib.info, "fusion_groups": [{"layers": names[:2],
                                                           "input": "shared"}]})
    kept = keep_float(calib, Sensitivity(_rows(("x", "input", 1.0))), 1)
    assert sorted(kept.info["keep_float"]["tensors"]) == sorted(f"{k} input" for k in names)
    assert kept.states == {}


def test_float_mode_on_a_convolution_says_nothing():
    """Only ``mode="dynamic"`` warns that a convolution's input is kept float instead."""
    calib = _mlp()[2]
    sens = Sensitivity(_rows(("0", "input", 1.0)), {"convolutions": ["0"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = keep_float(calib, sens, 1, mode="float")
    assert "input" not in kept.states["0"]


def test_a_dynamic_fallback_runs_as_a_dynamic_recipes_input():
    """``mode="dynamic"``: the input quantized per token at run time in the same format, as
    ``w8a8-dynamic`` calibrates it (its spec, its memoryless observer)."""
    model, xs, calib = _mlp()
    kept = keep_float(calib, Sensitivity(_rows(("0", "input", 1.0))), 1, mode="dynamic")
    want = _calibrate(model, xs, "w8a8-dynamic").states["0"]["input"]
    got = kept.states["0"]["input"]
    assert (got.spec, got.observer, got.dynamic) == (want.spec, want.observer, True)


# ----------------------------------------------------------------- calibrate's fallback


def test_check_fallback_refuses_a_bool_count():
    with pytest.raises(ValueError, match="keep_float must be a non-negative integer, got True"):
        check_fallback(True, "float")


def test_check_fallback_refuses_only_a_positive_count_with_sequential():
    """``keep_float=0`` ranks nothing, so it takes ``sequential``; 1 needs the whole model."""
    assert check_fallback(0, "float", sequential=True) is None  # no ValueError
    with pytest.raises(ValueError, match=r"^calibrate: keep_float needs the whole model's "):
        check_fallback(1, "float", sequential=True)


def test_a_ranker_takes_the_place_of_the_batch():
    """Across ranks ``batch`` may be None: the ``ranker``'s ranking is the one taken."""
    model, _, calib = _mlp()
    sens = Sensitivity(_rows(("2", "input", 1.0)))
    out = fall_back(model, None, calib, 1, "float", ranker=lambda rank: sens)
    assert out.info["keep_float"]["tensors"] == ["2 input"]


# --------------------------------------------------------------------- fallback_curve


def test_a_calibration_without_static_activations_has_a_zero_float_share():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    calib = _calibrate(model, [torch.randn(4, 16)], "w8a8-dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = fallback_curve(model, calib, Sensitivity([]), lambda m: 1.0, ns=(0, 1))
    assert [r["float_macs_pct"] for r in rows] == [0.0, 0.0]


def test_an_infinite_quality_is_kept_with_a_warning():
    """A broken model's inf perplexity: kept in its row, and warned of."""
    model, _, calib = _mlp()
    with pytest.warns(UserWarning, match="fallback_curve: evaluate returned inf for n=0"):
        rows = fallback_curve(model, calib, Sensitivity([]), lambda m: float("inf"), ns=(0,))
    assert rows[0]["quality"] == float("inf")
