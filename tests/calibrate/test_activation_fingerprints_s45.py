"""Fingerprints of the roles that are no weight (probe s45 p3): a calibration of activations
only (static inputs, the KV cache) recorded no fingerprint, so ``apply`` and every export took
another checkpoint of the same shapes without a word, its keys 4x larger clipped by the old
``k_scale``. Each calibrated role now records the fingerprint of the weight its values came
through -- an input's or output's layer weight, the projection that makes the cached keys or
values -- and the model is compared with it as a quantized weight is; a calibration saved
before (no such fingerprints) loads and applies unchecked, as before."""

import copy
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from test_kv_cache import tiny_gemma4_k_eq_v, tiny_phi3
from tiny_models import llama

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule, calibrate, load, preset
from quantscope.calibration.structure.fingerprint import fingerprint

torch.set_num_threads(1)

KV_ONLY = Recipe((), kv_cache="fp8")
INPUT_ONLY = Recipe((Rule(("re:.*proj$",), input=Role(QuantSpec("int8", "tensor"),
                                                      "minmax")),))
DIFFER = "is not the weight calibrated (its bits differ from the fingerprint calibrate recorded"


def _scaled(model, factor=4.0, name="k_proj"):
    """A copy of ``model`` whose every attention ``name`` weight is ``factor`` times larger (a
    "fine-tuned" model of the same shapes: its keys ``factor`` times larger)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for layer in other.model.layers:
            getattr(layer.self_attn, name).weight.mul_(factor)
    return other


@pytest.fixture(scope="module")
def kv_only():
    model, batches = llama()
    return model, batches, calibrate(model, batches, KV_ONLY, progress=False)


def test_a_kv_cache_role_records_the_projection_that_makes_it(kv_only):
    model, _, cal = kv_only
    for i, layer in enumerate(model.model.layers):
        states = cal.states[f"model.layers.{i}.self_attn"]
        assert set(states) == {"key", "value"}
        assert states["key"].fingerprint == fingerprint(layer.self_attn.k_proj.weight)
        assert states["value"].fingerprint == fingerprint(layer.self_attn.v_proj.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal.check_model(model, "export")  # its own model passes


def test_a_model_lacking_a_calibrated_attention_is_left_to_apply_to_name(kv_only):
    """Another model lacking layer 1, whose attention's projections the KV fingerprints
    name: no weight's bits are compared (as for a quantized weight's layer), so the error
    apply raises names the missing module, not a failure to find the projection."""
    _, _, cal = kv_only
    other = llama(seed=1)[0]
    other.model.layers = other.model.layers[:1]
    cal.check_model(other, "export")
    with pytest.raises(ValueError, match=r"apply: the model has no module 'model\.layers\.1\."):
        cal.apply(other)


def test_kv_cache_scales_onto_other_keys_are_refused(kv_only, tmp_path):
    model, _, cal = kv_only
    other = _scaled(model)
    for who, call in (("apply", lambda: cal.apply(other)),
                      ("export", lambda: quantscope.export(cal, other, tmp_path / "ct"))):
        with pytest.raises(ValueError, match=rf"^{who}: model\.layers\.0\.self_attn\.k_proj\."
                                             rf"weight {DIFFER.replace('(', '[(]')} for the key "
                                             rf"cache's scales\): .* --allow-other-weights\)$"):
            call()
    assert not (tmp_path / "ct").exists()
    values = _scaled(model, 2.0, "v_proj")
    with pytest.raises(ValueError, match=r"^apply: model\.layers\.0\.self_attn\.v_proj\.weight "
                                         r".* for the value cache's scales\)"):
        cal.apply(values)
    # the model calibrated still applies and exports; the override takes the other one
    cal.apply(model).remove()
    assert quantscope.export(cal, model, tmp_path / "own")
    loose = cal.without_fingerprints()
    assert all(st.fingerprint is None for roles in loose.states.values() for st in roles.values())
    loose.apply(other).remove()


def test_kv_cache_and_mlp_recipe_refuses_a_model_whose_k_proj_differs(tmp_path):
    """The KV scales come from k_proj / v_proj, which no weight role of an MLP-only recipe
    covers: the probe's w8a8 on the MLP plus an fp8 cache exported onto k_proj x3."""
    model, batches = llama()
    cal = calibrate(model, batches, preset("w8a8", targets=["re:.*mlp.*"], kv_cache="fp8"),
                    progress=False)
    assert not any("k_proj" in layer for layer in cal.states)
    with pytest.raises(ValueError, match=r"^export: model\.layers\.0\.self_attn\.k_proj\.weight "
                                         r".* for the key cache's scales\)"):
        quantscope.export(cal, _scaled(model, 3.0), tmp_path / "ct")
    assert quantscope.export(cal, model, tmp_path / "own")


def test_a_quantized_weight_and_its_input_scales_name_the_weight_itself():
    """w8a8: a Linear's weight and its static input carry one fingerprint (its weight's).
    Another weight is named as a quantized weight is, without "for its input scales" (the
    first role's words; the input's scales come through that same weight)."""
    model, batches = llama()
    cal = calibrate(model, batches, "w8a8", progress=False)
    q = cal.states["model.layers.0.self_attn.q_proj"]
    assert q["weight"].fingerprint == q["input"].fingerprint is not None
    with pytest.raises(ValueError, match=r"^apply: model\.layers\.0\.self_attn\.q_proj\.weight "
                                         r"is not the weight calibrated \(its bits differ from "
                                         r"the fingerprint calibrate recorded\): "):
        cal.apply(llama(seed=1)[0])


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


def test_a_calibration_saved_before_activation_fingerprints_applies_unchecked(kv_only,
                                                                               tmp_path):
    """A folder of an older quantscope (no fingerprint on a key / value / input role) loads,
    applies and exports onto any model of the same shapes, as before, without a word."""
    model, batches, kv = kv_only
    inputs = calibrate(model, batches, INPUT_ONLY, progress=False)
    other = _scaled(llama(seed=1)[0])
    for name, cal in (("kv", kv), ("inputs", inputs)):
        cal.save(tmp_path / name)
        meta_path = tmp_path / name / "quantscope.json"
        meta = json.loads(meta_path.read_text())
        assert meta["version"] == 2  # a version-1 reader refuses these fingerprints: "got 2"
        for roles in meta["layers"].values():
            for d in roles.values():
                assert d.pop("fingerprint")
        meta["version"] = 1  # as an older quantscope wrote it
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


def test_a_misspelt_fingerprint_is_refused_not_dropped(tmp_path):
    # an unknown key of a role was dropped: "fingerprnt" loaded as no fingerprint, so
    # apply() checked nothing about the weights
    model, batches = llama()
    calibrate(model, batches, "w8a8", progress=False).save(tmp_path / "cal")
    meta_path = tmp_path / "cal" / "quantscope.json"
    meta = json.loads(meta_path.read_text())
    role = meta["layers"]["model.layers.0.mlp.up_proj"]["weight"]
    role["fingerprnt"] = role.pop("fingerprint")
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"layers\.model\.layers\.0\.mlp\.up_proj\.weight\."
                                         r"fingerprnt: unknown key \(a role holds spec, "):
        load(tmp_path / "cal")


def test_a_weight_held_fake_quantized_is_left_to_apply_to_refuse(kv_only):
    """k_proj fake-quantized by another calibration's apply: its bits are not compared (they
    are no float weight), and apply says what is wrong: QDQ already applied."""
    model, batches, kv = kv_only
    weights = calibrate(model, batches, "w8a8", progress=False)
    with weights.apply(model), pytest.raises(ValueError,
                                             match="already has quantscope QDQ applied"):
        kv.apply(model)


@pytest.mark.parametrize(("build", "want"), [
    (tiny_phi3, {0: ("qkv_proj", "qkv_proj"), 1: ("qkv_proj", "qkv_proj")}),
    (tiny_gemma4_k_eq_v, {0: ("k_proj", "v_proj"), 1: ("k_proj", "k_proj")})])
def test_fused_and_k_eq_v_caches_record_the_projection_kv_routing_uses(build, want):
    """Phi-3 caches slices of its fused qkv_proj; Gemma 4's full-attention layer without a
    v_proj caches k_proj's output as its values too: those are the weights fingerprinted."""
    from quantscope.calibration.structure.fingerprint import source

    model = build()
    batch = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    cal = calibrate(model, [batch], KV_ONLY, progress=False)
    for i, (key, value) in want.items():
        layer = f"model.layers.{i}.self_attn"
        attn = model.get_submodule(layer)
        assert (source(model, layer, "key"), source(model, layer, "value")) == (
            f"{layer}.{key}", f"{layer}.{value}")
        assert cal.states[layer]["key"].fingerprint == fingerprint(getattr(attn, key).weight)
        assert cal.states[layer]["value"].fingerprint == fingerprint(
            getattr(attn, value).weight)
    cal.check_model(model, "export")
    other = copy.deepcopy(model)
    with torch.no_grad():
        getattr(other.get_submodule("model.layers.1.self_attn"), want[1][1]).weight.mul_(2.0)
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.self_attn\.{want[1][1]}\.weight "
                                         rf"is not the weight calibrated"):
        cal.check_model(other, "export")


def test_a_version_this_quantscope_does_not_read_is_refused_naming_those_it_does(tmp_path):
    model, batches = llama()
    calibrate(model, batches, "w8a8", progress=False).save(tmp_path / "cal")
    meta_path = tmp_path / "cal" / "quantscope.json"
    meta = json.loads(meta_path.read_text())
    for version, shown in ((3, "3"), (True, "True"), (2.0, "2.0"), ("2", "'2'")):
        meta["version"] = version  # JSON's true and 2.0 equal 1 and 2 in Python: no version
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=rf"version: this quantscope reads versions 1, 2, "
                                             rf"got {shown}$"):
            load(tmp_path / "cal")
