"""ONNX export under any module and tensor names: a Linear the forward calls through a second
attribute (``self.alias = self.b``) is the calibrated ``b``, and the names the QDQ rewrite
gives its new tensors never reuse the model's own (a Linear's buffer named ``input_scale``)."""

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from quantscope import calibrate, export
from quantscope.exporters import onnx as qonnx


def _batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 16, generator=g) for _ in range(n)]


def _export_vs_apply(model, path):
    """ORT's output of the exported w8a8 model, apply()'s, and the graph."""
    calib = calibrate(model, _batches(), "w8a8", progress=False)
    x = _batches(1, seed=7)[0]
    export.export(calib, model, path, format="onnx", example_inputs=(x,))
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad(), calib.apply(model):
        ref = model(x).numpy()
    return got, ref, onnx.load(str(path)).graph


def _integer_matmuls(graph):
    ops = [n.op_type for n in graph.node]
    return ops.count("QuantizeLinear"), ops.count("DequantizeLinear")


class _Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.alias = self.b  # the same module, a second name; the forward calls this one

    def forward(self, x):
        return self.alias(torch.relu(self.a(x)))


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Aliased()
        self.other = self.inner  # the whole block under a second name too

    def forward(self, x):
        return self.other(x)


@pytest.mark.parametrize("make", [_Aliased, _Outer])
def test_a_linear_called_through_a_second_name_exports_as_the_calibrated_one(tmp_path, make):
    torch.manual_seed(0)
    got, ref, graph = _export_vs_apply(make().eval(), tmp_path / "m.onnx")
    assert _integer_matmuls(graph) == (2, 4)  # both Linears: input Q/DQ and weight DQ
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()


class _Collides(nn.Module):
    """Tensors of its own under the names the rewrite would give its new ones."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.a.register_buffer("input_scale", torch.full((), 3.0))
        self.a.add_module("call1", nn.Linear(16, 16))  # "a.call1": a's second call's prefix
        self.b = nn.Linear(16, 16)
        self.b.register_buffer("weight_q", torch.full((16,), 2.0))
        # a Gemm's output "linear" becomes MatMul "linear_matmul" + Add "linear"
        self.linear_matmul = nn.Parameter(torch.full((16,), 0.5))

    def forward(self, x):
        h = torch.relu(self.a(x) * self.linear_matmul) * self.a.input_scale
        h = self.a.call1(self.a(h))
        return self.b(h) + self.b.weight_q


def test_new_tensor_names_never_reuse_the_models_own(tmp_path):
    torch.manual_seed(0)
    got, ref, graph = _export_vs_apply(_Collides().eval(), tmp_path / "m.onnx")
    names = [t.name for t in graph.initializer]
    assert len(names) == len(set(names))
    outputs = [o for n in graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))
    assert _integer_matmuls(graph) == (4, 8)  # a twice, a.call1, b
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()
