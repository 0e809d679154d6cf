"""ONNX export (probe s32): an opset torch.onnx reaches only through onnx's C-API converter
(26+ with torch 2.13) drops the module names the export finds each Linear by: refused naming
the opset, not blamed on the model ("never called as a module"); and which weight-only
Linears ONNX Runtime fuses into ``MatMulNBits``, as deploy.md's kernel table says."""

import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from quantscope import Channel, Group, QuantSpec, Tensor, calibrate, export
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.exporters import onnx as qonnx


def _weight_only(spec, width=96):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 16)).eval()
    recipe = Recipe(Rule(("Linear",), weight=Role(spec, "minmax")))
    return model, calibrate(model, [torch.randn(8, width)], recipe, progress=False)


def test_an_opset_past_torch_onnxs_own_is_refused_naming_it(tmp_path):
    model, calib = _weight_only(QuantSpec("int8", Channel(0)))
    path = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match=r"at opset 26 records no module names.*21 to 25"):
        export(calib, model, path, format="onnx", example_inputs=torch.randn(3, 96), opset=26)
    assert not path.exists()


@pytest.mark.parametrize(("spec", "kernel"), [
    (QuantSpec("int8", Channel(0)), "MatMulNBits"),
    (QuantSpec("int4", Group(32)), "MatMulNBits"),
    (QuantSpec("int4", Group(16)), "MatMulNBits"),
    (QuantSpec("int8", Tensor()), "MatMulNBits"),  # per tensor: a scalar scale, spread
    (QuantSpec("int4", Tensor()), "MatMulNBits"),
    (QuantSpec("int16", Channel(0)), "MatMul"),  # 16-bit
    (QuantSpec("int4", Group(48)), "MatMul"),  # not a power of two
    (QuantSpec("int4", Group(8)), "MatMul"),  # below 16
])
def test_which_weight_only_linears_ort_runs_as_matmulnbits(tmp_path, spec, kernel):
    model, calib = _weight_only(spec)
    path = str(tmp_path / "m.onnx")
    export(calib, model, path, format="onnx", example_inputs=torch.randn(2, 3, 96))
    sess = qonnx.session(path, threads=1, optimized_model_path=path + ".opt")
    assert qonnx.integer_kernel_counts(path + ".opt") == {kernel: 1}
    x = torch.randn(2, 3, 96)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad(), calib.apply(model):
        ref = model(x).numpy()
    assert abs(got - ref).max() <= 1e-5 * abs(ref).max()  # float32 sums in another order
