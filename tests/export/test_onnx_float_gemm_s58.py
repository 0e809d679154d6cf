"""ONNX export (probe s58): a Linear with a static input whose weight the recipe keeps float,
on a 2-D input, stays torch's ``Gemm``; between a DQ and a Q (the next layer's input pair)
ORT's WeightBiasQuantization quantized that float weight to int8 per tensor and its bias to
int32, so ``qonnx.session`` ran 0.2-1 % of the output's max off fake-quant. The session now
turns that optimizer off: it equals fake-quant to float rounding."""

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from quantscope import Channel, QuantSpec, calibrate, export
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.exporters import onnx as qonnx

A8 = QuantSpec("int8", "tensor")


class _Two(nn.Module):
    def __init__(self, between: nn.Module):
        super().__init__()
        self.a, self.between, self.b = nn.Linear(16, 8), between, nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.between(self.a(x)))


@pytest.mark.parametrize("between", [nn.ReLU(), nn.Identity()], ids=["relu", "identity"])
@pytest.mark.parametrize("b_weight", [True, False], ids=["b-w8a8", "b-a8"])
def test_float_weight_beside_a_static_input_stays_float(tmp_path, between, b_weight):
    torch.manual_seed(0)
    model = _Two(between).eval()
    b_roles = {"input": Role(A8)}
    if b_weight:
        b_roles["weight"] = Role(QuantSpec("int8", Channel(0)))
    recipe = Recipe((Rule(("a",), input=Role(A8)), Rule(("b",), **b_roles)))
    calib = calibrate(model, [torch.randn(8, 16)], recipe, progress=False)
    path = tmp_path / "m.onnx"
    export(calib, model, path, format="onnx", example_inputs=torch.randn(3, 16))
    x = torch.randn(7, 16)
    with torch.no_grad(), calib.apply(model):
        ref = model(x).numpy()
    got = qonnx.session(path, threads=1).run(None, {"x": x.numpy()})[0]
    assert np.abs(got - ref).max() <= 1e-6 * max(1.0, float(np.abs(ref).max()))
