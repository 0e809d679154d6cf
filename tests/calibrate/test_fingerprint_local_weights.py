"""NVFP4 weights with ``dynamic="local"`` (block scales at run time) keep a global scale
calibrated from the weight's own amax, so they are checked as static weights are: calibrate
records their shape and fingerprint, and apply refuses another model's weights (probe s44:
neither was recorded, so a model with x20 weights was applied without a word and every
weight clipped to the stale global scale; a model of other widths was accepted too). Only
run-time (``dynamic=True``) weight scales, which follow the weight, go unrecorded."""

import copy
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from tiny_models import llama

from quantscope import presets
from quantscope.calibration import Recipe, Role, Rule, calibrate, load
from quantscope.calibration.structure.fingerprint import fingerprint

torch.set_num_threads(1)

Q = "model.layers.0.self_attn.q_proj"


def _recipe(dynamic) -> Recipe:
    spec = presets.NVFP4 if dynamic == "local" else presets.INT8_PER_CHANNEL
    return Recipe((Rule(("Linear",), weight=Role(spec, "minmax", dynamic)),), name="w",
                  ignore=("lm_head",))


@pytest.fixture(scope="module")
def local():
    model, batches = llama()
    return model, calibrate(model, batches, _recipe("local"), progress=False)


def test_local_weights_record_their_shape_and_fingerprint(local):
    model, cal = local
    for layer, roles in cal.states.items():  # q/k/v, gate/up: one global scale, own shapes
        st, w = roles["weight"], model.get_submodule(layer).weight
        assert st.dynamic == "local" and st.qparams is None and st.global_amax is not None
        assert st.shape == tuple(w.shape) and st.fingerprint == fingerprint(w)
    runtime = calibrate(model, None, _recipe(True), progress=False)  # nothing calibrated
    assert all(r["weight"].fingerprint is None for r in runtime.states.values())


def test_other_weights_of_the_same_shapes_are_refused(local):
    """x20 weights: the global amax calibrated is 1/20 of theirs, so their block scales (e4m3,
    at most 448 times the global scale's unit) saturate and the largest values clip."""
    model, cal = local
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(20.0)
    w = other.get_submodule(Q).weight.detach().clone()
    with pytest.raises(ValueError, match=rf"^apply: {Q}\.weight is not the weight calibrated"):
        cal.apply(other)
    assert torch.equal(other.get_submodule(Q).weight, w)  # nothing applied
    with cal.without_fingerprints().apply(other):  # the override: clipped, as the check says
        clipped = other.get_submodule(Q).weight.detach().abs().max()
    assert clipped < 0.5 * w.abs().max()


def test_a_model_of_other_widths_is_refused_naming_the_shape(local):
    _, cal = local
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    wide = transformers.LlamaForCausalLM(cfg).eval()  # mlp 256 wide, calibrated 128
    with pytest.raises(ValueError, match=r"mlp\.(up|gate)_proj\.weight has shape \(256, 64\), "
                                         r"but was calibrated with shape \(128, 64\)"):
        cal.without_fingerprints().apply(wide)


def test_a_local_calibration_saved_before_fingerprints_loads_unchecked(local, tmp_path):
    """Saved with both, it loads both back; saved before (no fingerprint, shape null), it
    loads and applies to other weights without a word, as other such calibrations do."""
    model, cal = local
    cal.save(tmp_path / "cal")
    back = load(tmp_path / "cal").states[Q]["weight"]
    assert back.fingerprint == fingerprint(model.get_submodule(Q).weight)
    assert back.shape == tuple(model.get_submodule(Q).weight.shape)
    path = tmp_path / "cal" / "quantscope.json"
    meta = json.loads(path.read_text())
    for roles in meta["layers"].values():
        roles["weight"].pop("fingerprint")
        roles["weight"]["shape"] = None
    path.write_text(json.dumps(meta))
    old = load(tmp_path / "cal")
    assert all(r["weight"].fingerprint is None and r["weight"].shape is None
               for r in old.states.values())
    other = llama(seed=1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with old.apply(other):
            pass
