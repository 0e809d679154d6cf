"""ONNX export of a Linear before a BatchNorm (probe s28): torch.onnx's optimizer folded an
eval BatchNorm1d into the Linear's Gemm, which then had neither its node nor its weight, and
the export said the Linear was never called. The Linear now keeps its node and QDQ, the
BatchNorm stays a node, and ONNX Runtime equals ``apply()``; a Conv2d's BatchNorm2d (a float
Conv: the recipes quantize Linears) still folds and exports as before."""

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from quantscope import calibrate, export
from quantscope.calibration.recipe import preset
from quantscope.exporters import onnx as qonnx


def _stats(bn):
    """Running statistics and affine parameters far from the identity a fresh BatchNorm is
    (a fold then changes the weight by much more than float rounding)."""
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.2, 3)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)


def _export_and_run(model, x, path):
    calib = calibrate(model, [x, torch.randn_like(x)], preset("w8a8", "minmax"),
                      progress=False)
    export(calib, model, path, format="onnx", example_inputs=(x,))
    sess = qonnx.session(path, threads=1, optimized_model_path=str(path) + ".opt")
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad(), calib.apply(model):
        ref = model(x).numpy()
    return calib, got, ref, qonnx.integer_kernel_counts(str(path) + ".opt")


def test_a_linear_before_batchnorm1d_exports_quantized(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
                          nn.Linear(64, 32)).eval()
    _stats(model[1])
    x = torch.randn(8, 64)
    calib, got, ref, counts = _export_and_run(model, x, tmp_path / "m.onnx")
    assert set(calib.states) == {"0", "3"}
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert "BatchNormalization" in ops, ops  # not folded into layer 0's weight
    outputs = {o for n in graph.node for o in n.output}
    assert {"0.input_dq", "0.weight_dq", "3.input_dq", "3.weight_dq"} <= outputs
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), np.abs(got - ref).max()
    assert sum(counts.get(k, 0) for k in qonnx.INTEGER_KERNELS) == 2, counts


def test_a_conv2d_before_batchnorm2d_exports(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 16)).eval()
    _stats(model[1])
    x = torch.randn(4, 3, 6, 6)
    calib, got, ref, counts = _export_and_run(model, x, tmp_path / "m.onnx")
    assert set(calib.states) == {"4"}
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), np.abs(got - ref).max()
    assert sum(counts.get(k, 0) for k in qonnx.INTEGER_KERNELS) == 1, counts
