"""ONNX export probe fixes: asymmetric input rounding bounded, None / constant example entries,
the real cause of a torch.export failure, size-1 example dimensions, Linears never called or
called twice, weightless calibrated modules, overwrite of a suffix-less export, and 2-D
Linears on integer kernels with float fallbacks counted."""

import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from quantscope import Channel, Group, QuantSpec, Tensor, calibrate, export
from quantscope.calibration.recipe import Recipe, Role, Rule, preset
from quantscope.exporters import onnx as qonnx
from quantscope.exporters.atomic import check_writable_target


def _run(path, x):
    sess = qonnx.session(path, threads=1, optimized_model_path=str(path) + ".opt")
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    return got, qonnx.integer_kernel_counts(str(path) + ".opt")


def _fake_quant(model, calib, *args, **kwargs):
    with torch.no_grad(), calib.apply(model):
        return model(*args, **kwargs).numpy()


@pytest.mark.parametrize(("fmt", "symmetric"), [("uint8", False), ("int8", True)])
def test_input_codes_equal_fake_quant_symmetric_and_within_one_asymmetric(tmp_path, fmt,
                                                                         symmetric):
    """QuantizeLinear adds the zero point to round(x / s); fake-quant rounds x / s + zp in
    float32 (the deploy target's arithmetic). Inputs on the code midpoints: symmetric codes
    are equal, asymmetric ones differ (odd zero point: every tie) by one code at most."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(64))  # output = the input's fake-quant
    recipe = Recipe(Rule(("Linear",), weight=Role(QuantSpec("int8", Channel(0)), "minmax"),
                         input=Role(QuantSpec(fmt, Tensor(), symmetric=symmetric), "minmax")))
    calib = calibrate(model, [torch.randn(4, 64) * 2], recipe, progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx",
                  example_inputs=torch.randn(2, 3, 64))
    qp = calib.states["0"]["input"].qparams
    s, zp = float(qp.effective_scale.reshape(())), int(qp.zero_point.reshape(()))
    x = (torch.randint(-120, 120, (2, 128, 64)).float() + 0.5) * s
    got, _ = _run(path, x)
    diff = np.abs(got - _fake_quant(model, calib, x))
    if symmetric:
        assert zp == 0 and diff.max() <= 1e-6 * np.abs(got).max(), diff.max()
    else:
        assert zp % 2 == 1, zp  # the ties then round to the other neighbour
        assert diff.max() <= 1.01 * s, (diff.max(), s)
        assert (diff > s / 2).mean() > 0.2


class _Optional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x, mask=None, flag=False):
        y = self.a(x)
        y = y if mask is None else y * mask
        return -y if flag else y


@pytest.mark.parametrize("example", ["tuple", "dict"])
def test_none_and_constant_example_entries_export(tmp_path, example):
    torch.manual_seed(0)
    model, x = _Optional().eval(), torch.randn(2, 3, 16)
    calib = calibrate(model, [x], preset("w8a8", "minmax"), progress=False)
    inputs = (x, None, True) if example == "tuple" else {"x": x, "mask": None, "flag": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # sizes >= 2: no specialization warning
        path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=inputs)
    test = torch.randn(3, 5, 16)
    got, _ = _run(path, test)
    ref = _fake_quant(model, calib, test, None, True)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


class _Fails(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        if torch.compiler.is_exporting():
            raise RuntimeError("the real cause\nand its details")
        return self.fc(x)


def test_export_failure_names_the_innermost_cause_without_colour_codes(tmp_path):
    model, x = _Fails().eval(), torch.randn(2, 8)
    calib = calibrate(model, [x], preset("w8a8", "minmax"), progress=False)
    with pytest.raises(ValueError, match="could not export _Fails") as err:
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    msg = str(err.value)
    assert "RuntimeError: the real cause" in msg and "details" not in msg, msg
    assert "\x1b" not in msg and "\n" not in msg
    assert err.value.__cause__ is not None  # the chain is kept


def test_a_size_one_example_dimension_warns_naming_it(tmp_path):
    """torch.export specializes sizes 0 and 1: a batch-1 example makes a batch-1 graph."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16)).eval()
    calib = calibrate(model, [torch.randn(2, 3, 16)], preset("w8a8", "minmax"), progress=False)
    with pytest.warns(UserWarning, match=r"size 0 or 1 in example_inputs\['input'\] "
                                         r"\(1, 3, 16\) dimension \[0\].*>= 2"):
        export(calib, model, tmp_path / "m.onnx", format="onnx",
               example_inputs={"input": torch.randn(1, 3, 16)})


class _Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.spare = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.a(x)


def test_a_linear_never_called_is_named_as_never_called(tmp_path):
    torch.manual_seed(0)
    model, x = _Unused().eval(), torch.randn(2, 3, 32)
    calib = calibrate(model, [x], preset("w8a8", "minmax"), progress=False)
    with pytest.raises(ValueError, match=r"\['spare'\] never called as a module.*ignore"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert not (tmp_path / "m.onnx").exists()


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.a(torch.relu(self.a(x)))


@pytest.mark.parametrize("shape", [(2, 3, 32), (4, 32)])
def test_a_linear_called_twice_is_quantized_at_both_calls(tmp_path, shape):
    torch.manual_seed(0)
    model, x = _Twice().eval(), torch.randn(*shape)
    calib = calibrate(model, [x], preset("w8a8", "minmax"), progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    graph = onnx.load(path).graph
    assert sum(t.name.endswith("weight_q") for t in graph.initializer) == 1  # codes once
    got, counts = _run(path, x)
    ref = _fake_quant(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert counts == {"MatMulIntegerToFloat": 2}, counts


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x)


def test_a_weightless_or_missing_calibrated_module_is_a_value_error_naming_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), torch.nn.LayerNorm(32)).eval()
    x = torch.randn(2, 3, 32)
    block = calibrate(model, [x], Recipe(Rule(("_Block",), input=Role(
        QuantSpec("int8", Tensor()), "minmax"))), progress=False)
    with pytest.raises(ValueError, match="layer '0' is a _Block without a 2-D weight"):
        export(block, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    other = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 32)).eval()
    calib = calibrate(other, [x], preset("w8a8", "minmax"), progress=False)
    with pytest.raises(ValueError, match="layer '2' of the calibration is not a module"):
        export(calib, torch.nn.Sequential(torch.nn.Linear(32, 32)).eval(), tmp_path / "m.onnx",
               format="onnx", example_inputs=x)


def _onnx_file(path, ours: bool):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    proto = helper.make_model(graph)
    if ours:
        mark = proto.metadata_props.add()
        mark.key, mark.value = "quantscope", "onnx export"
    onnx.save(proto, path)


def test_overwrite_recognises_its_own_export_by_metadata_whatever_the_name(tmp_path):
    _onnx_file(tmp_path / "model", ours=True)
    check_writable_target(tmp_path / "model", overwrite=True, kind="file")  # replaceable
    _onnx_file(tmp_path / "foreign", ours=False)
    (tmp_path / "weights").write_bytes(b"\x08" + bytes(100))  # starts like one, is not
    for name in ("foreign", "weights"):
        with pytest.raises(ValueError, match="is not an ONNX file quantscope exported"):
            check_writable_target(tmp_path / name, overwrite=True, kind="file")


@pytest.mark.parametrize(("weight", "expected"), [
    (QuantSpec("int8", Channel(0)), {"MatMulIntegerToFloat": 2}),
    (QuantSpec("int8", Tensor()), {"MatMulIntegerToFloat": 2}),  # a scalar weight scale
    (QuantSpec("int4", Group(16)), {"MatMul": 2})])  # ORT has no int4 x int8 kernel
def test_2d_linears_run_as_integer_kernels_and_float_fallbacks_are_counted(tmp_path, weight,
                                                                           expected):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 64)).eval()
    x = torch.randn(4, 64)  # 2-D: torch exports each Linear as a Gemm
    recipe = Recipe(Rule(("Linear",), weight=Role(weight, "minmax"),
                         input=Role(QuantSpec("int8", Tensor()), "minmax")))
    calib = calibrate(model, [x], recipe, progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert "Gemm" not in {n.op_type for n in onnx.load(path).graph.node}
    got, counts = _run(path, x)
    ref = _fake_quant(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert counts == expected, counts


def test_integer_kernel_counts_counts_fused_float_gemms(tmp_path):
    from onnx import TensorProto, helper

    nodes = [helper.make_node("FusedGemm", ["a", "b"], ["c"], domain="com.microsoft"),
             helper.make_node("QGemm", ["c", "b"], ["d"], domain="com.microsoft")]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1]) for n in "abd"]
    proto = helper.make_model(helper.make_graph(nodes, "g", vi[:2], vi[2:]))
    onnx.save(proto, tmp_path / "g.onnx")
    assert qonnx.integer_kernel_counts(tmp_path / "g.onnx") == {"FusedGemm": 1, "QGemm": 1}
