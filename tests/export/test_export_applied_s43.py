"""Exporting a model while a calibration's QDQ is applied (review s43): ``with A.apply(model):
quantscope.export(B, model, ...)`` wrote A's fake-quantized weights, quantized again by B,
into the checkpoint without a word (the fingerprint check skips applied layers, leaving them
to apply()'s refusals, which an export never reached). Every export now refuses such a model
up front, as calibrate does, saying to export outside the ``with`` block; nothing is written."""

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration import calibrate

torch.set_num_threads(1)

_SAID = (r"export: the model has quantscope QDQ applied \(calibration.apply\); remove\(\) the "
         r"handle first: an export writes the weights the model holds, fake-quantized while "
         r"applied: export outside the `with calibration.apply\(model\):` block")


def _refused(cal, model, path, **options):
    with pytest.raises(ValueError, match=_SAID):
        quantscope.export(cal, model, path, **options)
    assert not path.exists()


@pytest.mark.parametrize("applied", ["same", "other"])
def test_compressed_tensors_export_of_an_applied_model_is_refused(tmp_path, applied):
    pytest.importorskip("compressed_tensors")
    pytest.importorskip("transformers")
    from tiny_models import llama

    model, batches = llama()
    fp8 = calibrate(model, batches, "fp8", progress=False)
    a = fp8 if applied == "same" else calibrate(model, batches, "w8a8", progress=False)
    float_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with a.apply(model):
        qdq = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        _refused(fp8, model, tmp_path / "applied")
    assert not torch.equal(qdq, float_q)  # the applied model held other weights
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, float_q)
    quantscope.export(fp8, model, tmp_path / "float")  # outside the block: the float weights


def test_onnx_export_of_an_applied_model_is_refused(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    cal = calibrate(model, [x], "w8a8", progress=False)
    with cal.apply(model):
        _refused(cal, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
        cal.check_model(model, "apply")  # apply's own refusals say why (already applied)


def test_check_model_refuses_an_applied_model_for_every_caller_but_apply():
    # any exporter (a caller of the public check_model by its own name), not only "export"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    cal = calibrate(model, [torch.randn(4, 8)], "w8a8", progress=False)
    with cal.apply(model):
        for who in ("export", "onnx export", "my exporter"):
            with pytest.raises(ValueError, match=rf"^{who}: the model has quantscope QDQ "
                                                 rf"applied \(calibration.apply\)"):
                cal.check_model(model, who)
        cal.check_model(model, "apply")


def test_a_model_holding_an_applied_one_is_refused_too(tmp_path):
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    cal = calibrate(inner, [x], "w8a8", progress=False)
    outer = nn.Sequential(inner)
    outer_cal = calibrate(outer, [x], "w8a8", progress=False)
    # the handle sits on inner; outer holds its QDQ'd weights
    with cal.apply(inner), pytest.raises(ValueError, match=_SAID):
        outer_cal.check_model(outer, "export")
