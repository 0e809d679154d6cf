"""A weight quantized at run time (``Role(dynamic=True)``, or NVFP4's ``"local"`` block
scales) has no scales a compressed-tensors checkpoint could store: its export is refused in
one line naming the layer and the feature, for every layout, before anything is copied or
written (probe s42 f9: a Group layout died inside compressed-tensors on ``scale.ndim``, a
Tensor one on ``Tensor / None``; only Channel got a message, about its layout)."""

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from tiny_models import llama

import quantscope
from quantscope import QuantSpec
from quantscope import presets as P
from quantscope.calibration import Recipe, Role, Rule, calibrate
from quantscope.exporters import compressed_tensors as ct
from quantscope.layout import Channel, Group, Tensor

torch.set_num_threads(1)


@pytest.mark.parametrize(("spec", "dynamic", "targets", "layer"), [
    (QuantSpec("int4", Group(32)), True, ("Linear",), "model.layers.0.self_attn.q_proj"),
    (QuantSpec("int8", Tensor()), True, ("Linear",), "model.layers.0.self_attn.q_proj"),
    (QuantSpec("int8", Channel(0)), True, ("Linear",), "model.layers.0.self_attn.q_proj"),
    (P.NVFP4, "local", ("re:.*o_proj$",), "model.layers.0.self_attn.o_proj"),
], ids=["group", "tensor", "channel", "nvfp4-local"])
def test_a_run_time_weight_scale_is_refused_naming_the_layer(tmp_path, monkeypatch, spec,
                                                             dynamic, targets, layer):
    model, batches = llama()
    recipe = Recipe((Rule(targets, weight=Role(spec, "memoryless_minmax", dynamic=dynamic)),),
                    ("lm_head",), "dynamic-weight")
    cal = calibrate(model, batches, recipe, progress=False)

    def no_copy(*_):
        raise AssertionError("the model was copied before the refusal")

    monkeypatch.setattr(ct.copy, "deepcopy", no_copy)  # before any work
    with pytest.raises(ValueError, match=rf"^export compressed-tensors: layer '{layer}' weight: "
                                         rf"dynamic={dynamic!r} \(a run-time weight scale.*"
                                         rf"calibrate the weight with dynamic=False$"):
        quantscope.export(cal, model, tmp_path / "ct")
    assert list(tmp_path.iterdir()) == []


def test_quantscope_export_refuses_it_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """``quantscope export RUN`` reads the run, then loads the model (the slow part): what the
    calibration alone decides is checked between, as for ONNX."""
    from tiny_models import llama_folder

    from quantscope import cli
    from quantscope.demo import models

    model, batches = llama()
    recipe = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int4", Group(32)),
                                                  "memoryless_minmax", dynamic=True)),),
                    ("lm_head",), "dynamic-weight")
    cal = calibrate(model, batches, recipe, progress=False)
    cal.info.update(model=str(llama_folder(tmp_path / "model")), task="causal-lm")
    cal.save(tmp_path / "run" / "qparams")

    def no_load(*_, **__):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(models, "load_model", no_load)
    rc = cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "ct")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (
        "quantscope export: error: export compressed-tensors: layer "
        "'model.layers.0.self_attn.q_proj' weight: dynamic=True (a run-time weight scale, "
        "computed from the weight at each call) has no compressed-tensors equivalent: a "
        "checkpoint stores each weight's codes with calibrated scales; calibrate the weight "
        "with dynamic=False"), err
    assert not (tmp_path / "ct").exists()
