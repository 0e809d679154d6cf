"""Fingerprints of the roles that are no weight (probe s45 p3d): a calibration of static
inputs only recorded no fingerprint, so ``apply`` and every export took another checkpoint of
the same shapes without a word. Each calibrated input or output role now records the
fingerprint of its layer's weight, which its values came through, and the model is compared
with it as a quantized weight is; a calibration saved before (no such fingerprints) loads and
applies unchecked, as before."""

import copy
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import llama

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, calibrate, load
from quantscope.calibration.structure.fingerprint import fingerprint

torch.set_num_threads(1)

INPUT_ONLY = Recipe((Rule(("re:.*proj$",), input=Role(QuantSpec("int8", "tensor"),
                                                      "minmax")),))
DIFFER = "is not the weight calibrated (its bits differ from the fingerprint calibrate recorded"


def test_static_input_scales_onto_other_weights_are_refused(tmp_path):
    model, batches = llama()
    cal = calibrate(model, batches, INPUT_ONLY, progress=False)
    for layer, roles in cal.states.items():
        assert list(roles) == ["input"]
        assert roles["input"].fingerprint == fingerprint(model.get_submodule(layer).weight)
    other = llama(seed=1)[0]
    with pytest.raises(ValueError, match=r"^apply: model\.layers\.0\.self_attn\.q_proj\.weight "
                                         r".* for its input scales\)"):
        cal.apply(other)
    with pytest.raises(ValueError, match=r"^export: model\.layers\.0\.self_attn\.q_proj\.weight "
                                         r".* for its input scales\)"):
        quantscope.export(cal, other, tmp_path / "ct")
    down = copy.deepcopy(model)  # one layer's weight one ulp off: that layer is named
    down.model.layers[1].mlp.down_proj.weight.data.view(torch.int32)[2, 3] += 1
    with pytest.raises(ValueError, match=r"^apply: model\.layers\.1\.mlp\.down_proj\.weight "):
        cal.apply(down)
    cal.apply(model).remove()
    assert quantscope.export(cal, model, tmp_path / "own")
    # saved and loaded, the fingerprints and the refusal stay
    cal.save(tmp_path / "cal")
    back = load(tmp_path / "cal")
    assert all(back.states[k]["input"].fingerprint == cal.states[k]["input"].fingerprint
               for k in cal.states)
    with pytest.raises(ValueError, match="for its input scales"):
        back.apply(other)


def test_a_static_input_shares_its_layers_weight_fingerprint_read_once(monkeypatch):
    """w8a8's static input and its weight record one fingerprint, and the check reads each
    weight once however many roles came through it."""
    from quantscope.calibration.structure import fingerprint as fp

    model, batches = llama()
    cal = calibrate(model, batches, "w8a8", progress=False)
    assert all(r["input"].fingerprint == r["weight"].fingerprint is not None
               for r in cal.states.values())
    calls = []
    monkeypatch.setattr(fp, "fingerprint", lambda w: calls.append(w) or fingerprint(w))
    cal.check_model(model, "export")
    assert len(calls) == len(cal.states)


def test_a_calibration_saved_before_activation_fingerprints_applies_unchecked(tmp_path):
    """A folder of an older quantscope (no fingerprint on an input role) loads, applies and
    exports onto any model of the same shapes, as before, without a word."""
    model, batches = llama()
    inputs = calibrate(model, batches, INPUT_ONLY, progress=False)
    other = llama(seed=1)[0]
    for name, cal in (("inputs", inputs),):
        cal.save(tmp_path / name)
        meta_path = tmp_path / name / "quantscope.json"
        meta = json.loads(meta_path.read_text())
        for roles in meta["layers"].values():
            for d in roles.values():
                assert d.pop("fingerprint")
        meta_path.write_text(json.dumps(meta))
        old = load(tmp_path / name)
        assert all(st.fingerprint is None for r in old.states.values() for st in r.values())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            old.apply(other).remove()
            assert quantscope.export(old, other, tmp_path / f"{name}-ct")


def test_a_fingerprint_on_a_run_time_role_is_refused_on_load(tmp_path):
    model, batches = llama()
    cal = calibrate(model, batches, "w8a8-dynamic", progress=False)
    cal.save(tmp_path / "cal")
    meta_path = tmp_path / "cal" / "quantscope.json"
    meta = json.loads(meta_path.read_text())
    meta["layers"]["model.layers.0.mlp.up_proj"]["input"]["fingerprint"] = "float32:" + "0" * 32
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"layers\.model\.layers\.0\.mlp\.up_proj\.input\."
                                         r"fingerprint: only a calibrated .* not a run-time"):
        load(tmp_path / "cal")
