"""Pins of the ONNX export (``exporters/onnx.py``, ``onnx_graph.py``, ``onnx_trace.py``) from a
mutation round (s65): behaviours no earlier test held, each checked against the definitions
(the module docs and docstrings, the ONNX operator definitions of ``Gemm`` /
``DequantizeLinear`` and ONNX Runtime's session options): the protobuf limit's boundary, the
session's options, x86 named ``AMD64``, weight layouts counted from either end, the ``Gemm``
forms read and rewritten (``transA`` / ``transB`` given as 0, no bias, name scopes kept),
``uint8`` moving int8 codes alone, torch.onnx's errors and size warnings, and what the
export writes (no helper domain in the opsets, a batch of another size, a list of inputs, a
tied input-only Linear, an output role refused)."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from test_onnx_s38 import _recipe, _ref, no_trace  # noqa: F401 (the fixture)

from quantscope import Channel, Group, QuantSpec, Tensor, calibrate, export
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.exporters import onnx as qonnx
from quantscope.exporters import onnx_graph, onnx_trace
from quantscope.presets import NVFP4

TP = onnx.TensorProto
INT8 = QuantSpec("int8", Tensor())


def test_a_graph_of_exactly_the_protobuf_limit_is_not_refused():
    """PROTOBUF_LIMIT is the most bytes one message holds: that many pass, one more is
    refused."""
    qonnx._check_size(qonnx.PROTOBUF_LIMIT, "in the graph")
    with pytest.raises(ValueError, match=r"over protobuf's 2 GiB limit"):
        qonnx._check_size(qonnx.PROTOBUF_LIMIT + 1, "in the graph")


def test_session_options_enable_all_optimizations_and_the_given_threads(tmp_path):
    so = qonnx.session_options(threads=3, optimized_model_path=tmp_path / "o.onnx")
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert so.intra_op_num_threads == 3
    assert so.get_session_config_entry(qonnx.FLOAT_MATMULNBITS[0]) == "1"
    assert so.optimized_model_filepath == str(tmp_path / "o.onnx")


def test_an_amd64_machine_is_x86_and_without_flags_counts_as_without_vnni(tmp_path,
                                                                           monkeypatch):
    """Windows names x86-64 ``AMD64``: an x86 CPU whose flags cannot be read is not exact."""
    import platform
    monkeypatch.setattr(platform, "machine", lambda: "AMD64")
    assert qonnx.int8_dot_product(str(tmp_path / "missing")) is False


@pytest.mark.parametrize(("layout", "form"), [
    (Channel(0), True), (Channel(-2), True), (Channel(1), False), (Channel(-1), False),
    (Group(32), True), (Group(32, axis=1), True), (Group(32, axis=0), False)])
def test_weight_layouts_count_a_2d_weights_axes_from_either_end(layout, form):
    """A 2-D weight's output channels are axis 0 or -2, its input features axis 1 or -1."""
    spec = QuantSpec("int8", layout)
    if form:
        assert onnx_graph.check_spec(spec, "l", "weight") == (TP.INT8, 8, True)
    else:
        with pytest.raises(ValueError, match=r"l\.weight: layout .* has no DequantizeLinear"):
            onnx_graph.check_spec(spec, "l", "weight")


def test_a_gemm_with_trans_b_given_as_0_multiplies_by_the_initializer_as_is():
    """Gemm computes ``A @ B`` where ``transB`` is 0 (given or not): its initializer is the
    Linear's weight ``[out, in]`` transposed; with ``transB=1`` the weight itself."""
    weight = np.arange(6, dtype=np.float32).reshape(3, 2)
    for attrs in ({}, {"transB": 0}):
        node = onnx.helper.make_node("Gemm", ["a", "b"], ["y"], **attrs)
        assert onnx_graph._weight_view(weight.T.copy(), weight, node) is True
        assert onnx_graph._weight_view(weight, weight, node) is None
    node = onnx.helper.make_node("Gemm", ["a", "b"], ["y"], transB=1)
    assert onnx_graph._weight_view(weight, weight, node) is False


def test_a_gemm_with_trans_a_given_as_0_is_plain():
    plain = onnx.helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=0)
    swapped = onnx.helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=1)
    assert onnx_graph._plain_gemm(plain) and not onnx_graph._plain_gemm(swapped)


def _scoped_gemm(inputs):
    node = onnx.helper.make_node("Gemm", inputs, ["y"], name="/fc/Gemm")
    node.metadata_props.add(key=onnx_graph._SCOPES, value="['', 'fc']")
    return node


def test_a_gemm_without_bias_becomes_one_matmul_writing_its_output():
    """An empty third input is no bias (ONNX's omitted optional input): no ``Add``."""
    for inputs in (["a", "b"], ["a", "b", ""]):
        (mm,) = onnx_graph._as_matmul(_scoped_gemm(inputs), "y_matmul")
        assert (mm.op_type, list(mm.input), list(mm.output)) == ("MatMul", ["a", "b"], ["y"])


def test_the_matmul_and_add_of_a_gemm_keep_its_name_scopes():
    mm, add = onnx_graph._as_matmul(_scoped_gemm(["a", "b", "c"]), "y_matmul")
    assert (list(mm.output), list(add.input), list(add.output)) == (
        ["y_matmul"], ["y_matmul", "c"], ["y"])
    assert onnx_graph._scopes(mm) == onnx_graph._scopes(add) == ["", "fc"]


@pytest.mark.parametrize("dtype", [TP.INT4, TP.UINT8, TP.INT16])
def test_uint8_moves_int8_codes_alone(dtype):
    """``uint8=True`` stores int8 codes as uint8; other storage types are kept as they are."""
    codes, zp = torch.tensor([[-3, 2]]), torch.tensor(1)
    got = onnx_graph.unsigned(dtype, codes, zp, True)
    assert got[0] == dtype and got[1] is codes and got[2] is zp


def test_an_empty_calibration_leaves_a_graph_without_module_names_as_it_is():
    """The opset refusal is for calibrated layers the graph cannot find: with none, nothing
    is refused, and a weight ``Transpose`` the graph outputs is kept with its initializer."""
    w = onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    nodes = [onnx.helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             onnx.helper.make_node("Relu", ["x"], ["y"])]
    outputs = [onnx.helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("y", "wt")]
    graph = onnx.helper.make_graph(nodes, "g", [], outputs, [w])
    onnx_graph.insert_qdq(onnx, graph, nn.Identity(), {}, False, 26)
    assert [n.op_type for n in graph.node] == ["Transpose", "Relu"]
    assert [t.name for t in graph.initializer] == ["w"]


def test_the_root_cause_is_the_first_non_empty_line_of_the_innermost_error():
    inner = ValueError("\n  \x1b[31mthe real cause\x1b[0m\nmore")
    outer = RuntimeError("banner")
    outer.__cause__ = inner
    assert onnx_trace._root_cause(outer) == "ValueError: the real cause"


def test_the_root_cause_stops_at_a_suppressed_context():
    """``raise ... from None`` hides the error it was raised while handling."""
    try:
        try:
            raise KeyError("hidden")
        except KeyError:
            raise RuntimeError("shown") from None
    except RuntimeError as e:
        assert onnx_trace._root_cause(e) == "RuntimeError: shown"


def test_a_0d_example_tensor_has_no_size_to_warn_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnx_trace.warn_specialized({"t": torch.tensor(2.0), "x": torch.ones(2, 3)})
    with pytest.warns(UserWarning, match=r"example_inputs\['x'\] \(1, 3\) dimension \[0\]"):
        onnx_trace.warn_specialized({"t": torch.tensor(2.0), "x": torch.ones(1, 3)})


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _run(path, x):
    sess = qonnx.session(path, threads=1)
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def test_a_list_example_exports_at_opset_25_dynamic_and_without_a_helper_domain(tmp_path):
    """A list of tensors is an example as a tuple is; opset 25, the highest torch.onnx writes
    itself (torch 2.13), is written; the domain the BatchNorm is held in while torch.onnx
    optimizes is not left among the model's opsets; a per-tensor weight's zero point is a
    scalar; the graph runs on another batch and sequence size, equal to ``apply()``."""
    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2, 3, 32)
    calib = calibrate(model, [x], _recipe(INT8, INT8), progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=[x],
                  opset=25)
    proto = onnx.load(str(path))
    opsets = {o.domain: o.version for o in proto.opset_import}
    assert opsets.get("") == 25 and set(opsets) <= {"", "ai.onnx"}
    # per tensor: a scalar zero point (its scale: test_onnx_defect_s65), no axis
    dims = {t.name: list(t.dims) for t in proto.graph.initializer}
    assert dims["a.weight_zero_point"] == dims["b.weight_zero_point"] == []
    dqs = [n for n in proto.graph.node if n.name.endswith("/weight_dq")]
    assert len(dqs) == 2 and not any(n.attribute for n in dqs)
    y = torch.randn(5, 4, 32)
    ref = _ref(model, calib, y)
    assert np.abs(_run(path, y) - ref).max() <= 1e-5 * np.abs(ref).max()


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(24, 16), nn.Linear(16, 24, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_tied_linear_whose_weight_stays_float_exports_its_input_zero_point_as_uint8(
        tmp_path):
    """Only a quantized weight may not be shared: an input-only Linear's weight stays the
    float tensor its Embedding reads too. ``uint8=True`` stores the int8 input's zero point
    as uint8, moved by 128 (the ``QuantizeLinear`` output type is its zero point's)."""
    torch.manual_seed(0)
    model, ids = _Tied().eval(), torch.randint(0, 24, (2, 5))
    calib = calibrate(model, [ids], _recipe(i=INT8), progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=ids,
                  uint8=True)
    zp = {t.name: t for t in onnx.load(str(path)).graph.initializer}["head.input_zero_point"]
    assert zp.data_type == TP.UINT8
    want = int(calib.states["head"]["input"].qparams.zero_point.reshape(())) + 128
    assert int(onnx.numpy_helper.to_array(zp)) == want
    ref = _ref(model, calib, ids)
    assert np.abs(_run(path, ids) - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.usefixtures("no_trace")
@pytest.mark.parametrize("opset", [20, 21.0, "21"])
def test_an_opset_below_21_or_not_an_integer_is_refused_before_the_trace(tmp_path, opset):
    """int4 and ``block_size`` need opset 21."""
    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2, 3, 32)
    calib = calibrate(model, [x], _recipe(QuantSpec("int8", Channel(0))), progress=False)
    with pytest.raises(ValueError, match=r"opset must be an integer >= 21"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x, opset=opset)


@pytest.mark.usefixtures("no_trace")
@pytest.mark.parametrize(("spec", "dynamic"), [(QuantSpec("fp8_e4m3", Tensor()), True),
                                               (NVFP4, "local")], ids=["fp8", "nvfp4"])
def test_a_run_time_float_input_is_refused_as_a_float_format(tmp_path, spec, dynamic):
    """A float format is told as such first, whether or not its scales are computed at run
    time."""
    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2, 3, 32)
    recipe = Recipe(Rule(("Linear",), weight=Role(QuantSpec("int8", Channel(0)), "minmax"),
                         input=Role(spec, "minmax", dynamic=dynamic)))
    calib = calibrate(model, [x], recipe, progress=False)
    with pytest.raises(ValueError, match=r"onnx export: a\.input is .*integer formats only"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)


@pytest.mark.usefixtures("no_trace")
def test_an_output_role_is_refused_before_the_trace(tmp_path):
    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2, 3, 32)
    recipe = Recipe(Rule(("Linear",), weight=Role(QuantSpec("int8", Channel(0)), "minmax"),
                         output=Role(INT8, "minmax")))
    calib = calibrate(model, [x], recipe, progress=False)
    with pytest.raises(ValueError, match=r"onnx export: a\.output: only weight and input roles"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert not (tmp_path / "m.onnx").exists()
