"""One ONNX export checks the calibration's roles once: ``_check_call`` ran ``_check_roles``
itself and again through ``check_exportable``. The command line's early check (before the
model loads) still runs them without a model; the export then checks the layers too."""

import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

import quantscope
from quantscope.calibration import preset
from quantscope.exporters import onnx as qonnx

torch.set_num_threads(1)


def _counted(monkeypatch, name):
    calls = []
    real = getattr(qonnx, name)
    monkeypatch.setattr(qonnx, name, lambda *a: calls.append(a) or real(*a))
    return calls


def test_one_export_checks_the_roles_and_layers_once(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    batches = [torch.randn(4, 16) for _ in range(2)]
    calib = quantscope.calibrate(model, batches, preset("w8a8"), progress=False)
    roles, linear = _counted(monkeypatch, "_check_roles"), _counted(monkeypatch, "_check_linear")
    quantscope.export(calib, model, tmp_path / "m.onnx", format="onnx",
                      example_inputs=(batches[0],))
    assert (tmp_path / "m.onnx").exists()
    assert len(roles) == 1 and len(linear) == 1
    roles.clear(), linear.clear()
    qonnx.check_exportable(calib.states)  # the CLI's, before the model is loaded
    assert len(roles) == 1 and linear == []
