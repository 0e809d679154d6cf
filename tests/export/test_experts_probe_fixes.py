"""Experts the export cannot write per expert (gpt-oss: 3-D on disk) but that the calibration
left in float are written as the model holds them."""

import pytest
import torch

from quantscope.calibration import calibrate, preset

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from tiny_models import gpt_oss


@pytest.mark.parametrize("ignore", [["re:.*experts.*"], ["*experts*"]])
def test_gpt_oss_experts_ignored_export_in_float(ignore, tmp_path):
    from safetensors.torch import load_file

    model, batches = gpt_oss()
    calib = calibrate(model, batches, preset("w8a8", ignore=ignore), progress=False)
    assert not any("experts" in k for k in calib.states)
    calib.export(model, tmp_path / "ct")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(tensors[key], model.state_dict()[key])


def test_gpt_oss_experts_quantized_still_refused(tmp_path):
    model, batches = gpt_oss()
    calib = calibrate(model, batches, "w8a8", progress=False)
    with pytest.raises(ValueError, match=r"experts module 'model\.layers\.0\.mlp\.experts'"):
        calib.export(model, tmp_path / "ct")
