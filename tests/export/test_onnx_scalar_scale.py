"""A per-tensor weight's ``DequantizeLinear`` scale is a scalar, as its zero point and the
input's (ONNX DequantizeLinear, opset 21: a scalar scale per tensor, a 1-D one per axis along
``axis``, default 1, whose size it must then have; the zero point of the scale's shape). It
was written 1-D (``np.ascontiguousarray`` of a 0-d array returns one dimension), which ONNX
Runtime happens to read as per tensor but a stricter consumer may take for per axis 1 of the
``[in, out]`` codes. Found by the s65 mutation round of the ONNX export."""

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from test_onnx_s38 import _recipe

from quantscope import QuantSpec, Tensor, calibrate, export


def test_a_per_tensor_weight_scale_is_a_scalar_as_its_zero_point(tmp_path):
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(32, 16)).eval(), torch.randn(2, 3, 32)
    spec = QuantSpec("int8", Tensor())
    calib = calibrate(model, [x], _recipe(spec, spec), progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    dims = {t.name: list(t.dims) for t in onnx.load(str(path)).graph.initializer}
    assert dims["0.input_scale"] == dims["0.input_zero_point"] == []
    assert dims["0.weight_zero_point"] == []
    assert dims["0.weight_scale"] == []  # [1]: per axis 1 of the [in, out] codes
