"""Pins of the ONNX graph rewrite (``exporters/onnx_graph.py``) from a mutation round (s70):
behaviours no earlier test held, each checked against the module's docstrings and the ONNX
operator definitions (``Transpose``'s default ``perm`` reverses the axes): which nodes read a
weight (a same-shaped tensor of other values is not the weight, a weight ``Transpose`` is one
that swaps the two axes of an initializer), the static input's full code range at both ends,
the free names the rewrite takes (the first ``base_n`` clear of every suffix, each given out
once), the innermost calibrated module owning a node, a Linear's later calls named
``{layer}.call1``, ``.call2``... (not numbered as a clashing name), a later call's shared weight
DequantizeLinear keeping the first's ``axis`` and ``block_size``, and a tied weight read under
its other module's name counted as a read outside the calibrated layer (the last three from a
second pass over the mutants the first left unrun). Each graph is built by hand: no trace."""

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper
from test_export_pins_s63 import _role_state

from quantscope import Channel, Group, QuantSpec, Tensor
from quantscope.exporters import onnx_graph
from quantscope.qparams import QParams


def _state(spec, rows):
    """A static role of ``rows`` scales (0.01) and zero points (0)."""
    return _role_state(spec, "minmax", QParams(torch.full((rows, 1), 0.01),
                                               torch.zeros(rows, 1, dtype=torch.int32)))


def _node(op, inputs, output, scopes, **attrs):
    """A node as torch.onnx writes it: its module names recorded, its op's last."""
    node = helper.make_node(op, inputs, [output], name=f"/{output}", **attrs)
    node.metadata_props.add(key=onnx_graph._SCOPES, value=repr(scopes))
    return node


def _graph(nodes, weights, outputs):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])]
    return helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                             for o in outputs],
        [numpy_helper.from_array(w.detach().numpy().copy(), n) for n, w in weights.items()])


@pytest.mark.parametrize(("node", "swaps"), [
    (helper.make_node("Transpose", ["w"], ["t"]), True),
    (helper.make_node("Transpose", ["w"], ["t"], perm=[1, 0]), True),
    (helper.make_node("Transpose", ["w"], ["t"], perm=[0, 1]), False),
    (helper.make_node("Identity", ["w"], ["t"]), False),
    (helper.make_node("Transpose", ["x"], ["t"]), False)],
    ids=["default_perm", "perm_10", "perm_01", "identity", "not_an_initializer"])
def test_a_weight_transpose_swaps_the_two_axes_of_an_initializer(node, swaps):
    """ONNX's ``Transpose`` without ``perm`` reverses the axes (``[1, 0]`` for a 2-D
    initializer); ``perm=[0, 1]`` or another op moves nothing."""
    inits = {"w": numpy_helper.from_array(np.ones((2, 3), np.float32), "w")}
    assert onnx_graph._swaps(node, inits) is swaps


@pytest.mark.parametrize(("attrs", "view"), [({}, "T"), ({"transB": 1}, "as_is")])
def test_a_same_shaped_tensor_of_other_values_is_not_the_weight(attrs, view):
    """``_weight_view`` compares the values, not the shape alone: a square initializer that
    is not the weight (nor its transpose) is another tensor (None)."""
    weight = np.arange(4, dtype=np.float32).reshape(2, 2)
    node = helper.make_node("Gemm", ["a", "b"], ["y"], **attrs)
    held = weight.T.copy() if view == "T" else weight
    assert onnx_graph._weight_view(held, weight, node) is (view == "T")
    assert onnx_graph._weight_view(held + 1, weight, node) is None


@pytest.mark.parametrize("spec", [
    QuantSpec("int8", Tensor(), quant_max=100), QuantSpec("uint8", Tensor(), quant_max=200),
    QuantSpec("uint8", Tensor(), symmetric=False, quant_min=0, quant_max=254)],
    ids=["int8_to_100", "uint8_to_200", "uint8_to_254"])
def test_a_static_input_whose_codes_stop_below_the_types_top_is_refused(spec):
    """``QuantizeLinear`` saturates to its type's full range: a range ending short of its
    top (not only of its bottom) has no form."""
    with pytest.raises(ValueError, match=r"l\.input: codes \[-?\d+, \d+\] are not a full"):
        onnx_graph.check_spec(spec, "l", "input")


def _rewrite(taken):
    graph = helper.make_graph([], "g", [], [])
    rewrite = onnx_graph._Rewrite(onnx, graph, nn.Identity(), {}, False)
    rewrite.taken.update(taken)
    return rewrite


def test_a_free_name_is_the_first_numbered_one_clear_of_every_suffix_and_then_taken():
    """``_free``: ``base``, else ``base_1``, ``base_2``... the first none of whose names
    ``+ suffix`` the graph has (one taken suffix is enough to pass it over); a name given
    out is taken, so the next asks get the next free one."""
    rewrite = _rewrite({"l.input_scale", "l_1.weight_dq"})
    assert rewrite._free("l", onnx_graph._SUFFIXES) == "l_2"
    assert rewrite._free("l", onnx_graph._SUFFIXES) == "l_3"
    assert rewrite._free("y_matmul") == "y_matmul"
    assert rewrite._free("y_matmul") == "y_matmul_1"


def test_a_node_belongs_to_the_innermost_calibrated_module_it_was_recorded_under():
    """A calibrated Linear holding another: a MatMul recorded under both is the inner one's
    (the name scopes run root first), and each gets its own weight DequantizeLinear."""
    model = nn.Sequential()
    model.add_module("outer", nn.Linear(4, 4))
    model.outer.add_module("inner", nn.Linear(4, 4))
    nodes = [_node("Gemm", ["x", "outer.inner.weight"], "h",
                   ["", "outer", "outer.inner", "linear"], transB=1),
             _node("Gemm", ["h", "outer.weight"], "y", ["", "outer", "linear_1"], transB=1)]
    graph = _graph(nodes, {"outer.inner.weight": model.outer.inner.weight,
                           "outer.weight": model.outer.weight}, ["y"])
    spec = QuantSpec("int8", Channel(0))
    states = {"outer": {"weight": _state(spec, 4)}, "outer.inner": {"weight": _state(spec, 4)}}
    onnx_graph.insert_qdq(onnx, graph, model, states, False, 21)
    assert {t.name for t in graph.initializer if t.name.endswith(".weight_q")} == {
        "outer.weight_q", "outer.inner.weight_q"}


def _linear():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 3))
    return model


def test_a_linears_later_calls_are_named_call1_call2_after_it():
    """A Linear called more than once: its first call's tensors are named after the layer,
    the k-th later call's after ``{layer}.call{k}`` (``_free`` numbers ``_1`` a name the
    graph already holds, not a call)."""
    model = _linear()
    nodes = [_node("Gemm", [x, "fc.weight"], y, ["", "fc", "linear"], transB=1)
             for x, y in (("x", "h"), ("h", "g"), ("g", "y"))]
    graph = _graph(nodes, {"fc.weight": model.fc.weight}, ["y"])
    qp = QParams(torch.full((3, 1), 0.01), torch.zeros(3, 1, dtype=torch.int32))
    states = {"fc": {"weight": _role_state(QuantSpec("int8", Channel(0)), "minmax", qp)}}
    onnx_graph.insert_qdq(onnx, graph, model, states, False, 21)
    assert [n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"] == [
        "fc.weight_dq", "fc.call1.weight_dq", "fc.call2.weight_dq"]


def test_a_later_calls_shared_weight_dq_keeps_the_groups_axis_and_block_size():
    """Beside an 8-bit input a later call's weight DequantizeLinear reads the first call's
    codes, scale and zero point: its ``axis`` and ``block_size`` must be theirs too (a
    blocked DequantizeLinear without ``block_size`` is no valid node)."""
    model = _linear()
    nodes = [_node("Gemm", [x, "fc.weight"], y, ["", "fc", "linear"], transB=1)
             for x, y in (("x", "h"), ("h", "y"))]
    graph = _graph(nodes, {"fc.weight": model.fc.weight}, ["y"])
    weight = QParams(torch.full((3, 2), 0.01), torch.zeros(3, 2, dtype=torch.int32))
    act = QParams(torch.tensor(0.01), torch.tensor(0, dtype=torch.int32))
    states = {"fc": {"weight": _role_state(QuantSpec("int4", Group(2)), "minmax", weight),
                     "input": _role_state(QuantSpec("int8", Tensor()), "minmax", act)}}
    onnx_graph.insert_qdq(onnx, graph, model, states, False, 21)
    first, later = (n for n in graph.node if n.output[0].endswith(".weight_dq"))
    assert list(later.input) == list(first.input)
    assert {a.name: a.i for a in later.attribute} == {"axis": 0, "block_size": 2}


def test_a_tied_weights_read_under_its_other_name_is_an_outside_read():
    """torch.onnx may name a tied weight's initializer after any module holding it: a read
    of ``b.weight`` (the calibrated ``a``'s own weight) by module ``b`` is a read outside
    ``a``."""
    ir = pytest.importorskip("onnx_ir")
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 3))
    model.add_module("b", nn.Linear(4, 3))
    model.b.weight = model.a.weight
    nodes = [_node("Gemm", ["x", "b.weight"], "h", ["", "a", "linear"], transB=1),
             _node("Gemm", ["x", "b.weight"], "y", ["", "b", "linear_1"], transB=1)]
    proto = helper.make_model(_graph(nodes, {"b.weight": model.a.weight}, ["h", "y"]))
    states = {"a": {"weight": None}}
    found = onnx_graph.outside_reads(ir.from_proto(proto).graph, model, states)
    assert list(found) == ["a"]
    assert "read outside a (by a Gemm in module 'b')" in found["a"]
