"""The sensitivity measures on a model other than the one calibrated (probe s44): apply() and
the exports refuse it (``Calibration.check_model``: weight fingerprints, SmoothQuant's
smoothing), but ``quantscope.sensitivity(..., calibration=)`` and ``layer_sensitivity``
ranked it silently, by scales that do not fit its weights (a smoothed calibration's
down_proj weight scored 0.38 on the float model, 6e-05 on the smoothed one), and keep_float
then took the wrong layers. Both now refuse it by apply()'s rule, before any forward, and
take it knowingly through ``calibration.without_fingerprints()``, as apply() does."""

import copy

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import Outliers
from quantscope.calibration.choice import output_sensitivity
from quantscope.calibration.choice.sensitivity import layer_sensitivity

pytest.importorskip("transformers")
from tiny_models import llama

torch.set_num_threads(1)

_MEASURES = {
    "sensitivity": lambda m, xs, c: quantscope.sensitivity(m, xs, calibration=c),
    "layer_sensitivity": lambda m, xs, c: layer_sensitivity(m, xs, c),
}


def _forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("who", sorted(_MEASURES))
def test_other_weights_are_refused_as_apply_refuses_them(who):
    a, batches = llama(0)
    b, _ = llama(1)  # the same architecture, other weights
    calib = quantscope.calibrate(a, batches, "w8a8", progress=False)
    with pytest.raises(ValueError) as applied:
        calib.apply(b)
    calls = _forwards(b)
    with pytest.raises(ValueError) as measured:
        _MEASURES[who](b, batches[:1], calib)
    assert calls == []  # refused before the float reference's forward
    # apply()'s message, naming the call: the first weight that differs and the override
    assert str(measured.value) == str(applied.value).replace("apply:", f"{who}:", 1)
    assert str(measured.value).startswith(
        f"{who}: model.layers.0.self_attn.q_proj.weight is not the weight calibrated")
    assert "calibration.without_fingerprints()" in str(measured.value)


@pytest.mark.parametrize("who", sorted(_MEASURES))
def test_a_smoothed_calibration_on_the_float_model_is_refused(who):
    float_model, batches = llama(0)
    smoothed = copy.deepcopy(float_model)
    calib = quantscope.calibrate(smoothed, batches, "w8a8", outliers=Outliers(smooth=0.8),
                                 progress=False)
    with pytest.raises(ValueError, match=f"^{who}: the calibration was made on SmoothQuant-"
                                         f"smoothed weights .* is not smoothed"):
        _MEASURES[who](float_model, batches[:1], calib)
    ranked = _MEASURES[who](smoothed, batches[:1], calib)  # its own model: measured
    assert {(r["layer"], r["role"]) for r in ranked.rows} <= {
        (layer, role) for layer, roles in calib.states.items() for role in roles}
    assert len(ranked.rows) > 20


def test_without_fingerprints_measures_other_weights_knowingly():
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(32, 16)), nn.Sequential(nn.Linear(32, 16))
    xs = [torch.randn(4, 32) for _ in range(2)]
    calib = quantscope.calibrate(a, xs, "w8a8", progress=False)
    for who, measure in _MEASURES.items():
        with pytest.raises(ValueError, match=f"^{who}: 0.weight is not the weight calibrated"):
            measure(b, xs, calib)
    knowingly = calib.without_fingerprints()
    rows = quantscope.sensitivity(b, xs, calibration=knowingly).rows
    assert sorted((r["layer"], r["role"]) for r in rows) == [("0", "input"), ("0", "weight")]
    # a's scales on b's weights: int8 symmetric per output row, scale 2 max|W_a| / 255
    (row,) = layer_sensitivity(b, xs, knowingly, roles=("weight",)).rows
    wa, wb = (m[0].weight.detach().double() for m in (a, b))
    scale = (2 * wa.abs().amax(1, keepdim=True) / 255).float().double()
    q = (wb / scale).round().clamp(-128, 127) * scale
    x = torch.cat(xs).double()
    want = float((x @ (q - wb).T).square().sum() / (x @ wb.T).square().sum())
    assert row["divergence"] == pytest.approx(want, rel=1e-4)


def test_a_model_with_qdq_applied_is_refused_by_layer_sensitivity():
    # its "float" outputs would be the fake-quantized model's (sensitivity refused it before)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    xs = [torch.randn(4, 32)]
    calib = quantscope.calibrate(model, xs, "w8a8", progress=False)
    with calib.apply(model), pytest.raises(
            ValueError, match="^layer_sensitivity: the model has quantscope QDQ applied .* "
                              "fake-quantized model"):
        layer_sensitivity(model, xs, calib)


def _public_sensitivity(model, batches, calibration):
    return quantscope.sensitivity(model, batches, calibration=calibration)


@pytest.mark.parametrize("who,call", [("sensitivity", output_sensitivity.measure),
                                      ("sensitivity", _public_sensitivity),
                                      ("layer_sensitivity", layer_sensitivity)],
                         ids=["measure", "sensitivity", "layer_sensitivity"])
def test_a_model_that_is_no_module_is_refused_naming_its_type(who, call):
    """None, or the Calibration passed in the model's place: refused naming the call and the
    type before anything reads the model (not an AttributeError from apply()'s checks)."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 8)]
    calib = quantscope.calibrate(nn.Sequential(nn.Linear(8, 8)), xs, "w8a8", progress=False)
    for bad, name in ((None, "NoneType"), (calib, "Calibration")):
        with pytest.raises(TypeError, match=rf"^{who}: model must be a torch.nn.Module, got "
                                            rf"{name}$"):
            call(bad, xs, calib)


@pytest.mark.parametrize("how", [*sorted(_MEASURES), "measure"])
@pytest.mark.parametrize("kind", ["tensor", "dict"])
@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
def test_a_batch_of_empty_sequences_is_refused_before_its_forward(how, kind, stream):
    # token ids of 0 tokens counted as one (a document kept), so the model's attention met
    # "cannot reshape tensor of 0 elements" and nothing named the batch
    model, batches = llama(0)
    calibration = quantscope.calibrate(model, batches, "w8a8", progress=False)
    ids = torch.zeros(2, 0, dtype=torch.long)
    empty, where = (ids, "input") if kind == "tensor" else ({"input_ids": ids}, "input_ids")
    given = [batches[0], empty]
    calls = _forwards(model)
    run = _MEASURES.get(how, output_sensitivity.measure)  # (what sensitivity() runs)
    who = "sensitivity" if how == "measure" else how
    with pytest.raises(ValueError, match=rf"^{who}: batch 1's {where} has shape \(2, 0\): "
                                         rf"its dimension 1 is empty"):
        run(model, (b for b in given) if stream else given, calibration)
    assert len(calls) <= (1 if stream else 0)  # (a stream's batch 0 may run before it)


def test_sensitivity_refuses_empty_sequences_before_calibrating():
    model, batches = llama(0)
    calls = _forwards(model)
    with pytest.raises(ValueError, match=r"^sensitivity: batch 0's input_ids has shape"):
        quantscope.sensitivity(model, iter([{"input_ids": torch.zeros(1, 0, dtype=torch.long)}]),
                               "w8a8", calib_batches=batches, progress=False)
    assert not calls
