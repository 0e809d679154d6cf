"""Pins of the ONNX export's parts (``exporters/onnx_tensors.py``, ``onnx_trace.py``) from
the s69 mutation round: each test fails on a mutant the existing tests let through. Expected
values come from the modules' docs and docstrings: a bf16 / fp16 model exported from a
float32 copy (a bf16 buffer counts, the model given is left as it was, bf16 example tensors
cast in every form, integer ones kept), the forward's fp16 casts made float32 and nothing
else changed, a ``QuantizeLinear`` reading any float other than float32 refused naming its
(nested) layer, only int8 codes read by several ``DequantizeLinear`` nodes copied (under new
names, beside a zero point that is missing or computed), ``use_cache`` off while exporting
and restored, the machine's errors passed through ``exporter_errors``, a BatchNorm after a
``Gemm`` alone held apart while torch.onnx optimizes, the root cause's first line and the
example sizes torch.export specializes."""

import types

import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper

from quantscope.exporters import onnx_trace
from quantscope.exporters.onnx_tensors import (
    check_float32_quantize,
    float32_graph,
    float32_model,
    unshared_codes,
)


class _Buffered(nn.Module):
    """Float32 parameters and one bf16 buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("table", torch.ones(2, dtype=torch.bfloat16))


def _example(form):
    x, ids = torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2, dtype=torch.int64)
    return {"dict": {"x": x, "ids": ids}, "tuple": (x, ids), "list": [x, ids],
            "tensor": x}[form]


@pytest.mark.parametrize("form", ["dict", "tuple", "list", "tensor"])
def test_a_low_precision_model_is_exported_from_a_float32_copy_with_float32_inputs(form):
    """Any bf16 / fp16 buffer makes the copy (the buffers are the model's too); its bf16
    example tensors become float32 in every form, an integer one (token ids) stays as it
    was, and the model given is left as it was (a copy)."""
    model = _Buffered()
    copy, inputs = float32_model(model, _example(form))
    assert copy is not model and copy.table.dtype == torch.float32
    assert model.table.dtype == torch.bfloat16
    got = list(inputs.values()) if form == "dict" else list(inputs) if form != "tensor" \
        else [inputs]
    assert [t.dtype for t in got] == [torch.float32, torch.int64][:len(got)]


def _cast_graph():
    return helper.make_graph(
        [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
         helper.make_node("Constant", [], ["k"], value_int=TensorProto.BFLOAT16),
         helper.make_node("Relu", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])],
        value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2]),
                    helper.make_tensor_value_info("k", TensorProto.INT64, [])])


def test_the_float32_graph_makes_an_fp16_cast_float32_and_leaves_the_rest():
    """A cast the forward makes to fp16 casts to float32 (as one to bf16 does); an integer
    attribute of another node that happens to equal a low type's number is no cast and is
    kept, as is the value_info of a value that is not bf16 / fp16."""
    graph = _cast_graph()
    float32_graph(graph)
    assert graph.node[0].attribute[0].i == TensorProto.FLOAT
    assert graph.node[1].attribute[0].i == TensorProto.BFLOAT16
    assert [v.name for v in graph.value_info] == ["k"]
    assert graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT


def _model(nodes, inputs, initializers):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, [2]) for n, t in inputs],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.UNDEFINED, None)],
        initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _scalar(name, dtype, value):
    return helper.make_tensor(name, dtype, [], [value])


def _quantize(x_type, scale_type=TensorProto.FLOAT, name="fc/input_q", x_init=False):
    """One QuantizeLinear reading ``x`` (a graph input, or with ``x_init`` an initializer)."""
    inits = [_scalar("s", scale_type, 0.5), _scalar("z", TensorProto.INT8, 0)]
    if x_init:
        inits.append(helper.make_tensor("x", x_type, [2], [1.0, 2.0]))
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name=name)
    return _model([node], [] if x_init else [("x", x_type)], inits)


@pytest.mark.parametrize(("model", "message"), [
    (_quantize(TensorProto.FLOAT16), "fc: QuantizeLinear reads 'x' as float16"),
    (_quantize(TensorProto.DOUBLE, name="enc/fc/input_q"),
     "enc/fc: QuantizeLinear reads 'x' as double"),
    (_quantize(TensorProto.BFLOAT16, x_init=True), "fc: QuantizeLinear reads 'x' as bfloat16"),
    (_quantize(TensorProto.FLOAT, TensorProto.BFLOAT16),
     "fc: QuantizeLinear reads 's' as bfloat16")],
    ids=["fp16", "nested_layer", "bf16_constant", "bf16_scale"])
def test_a_quantize_linear_reading_a_float_other_than_float32_is_refused(model, message):
    """Any input (the scale too), a constant as well as a graph input, fp16 as well as bf16
    and float64; the layer is the node's name less its last part (``<layer>/input_q``)."""
    with pytest.raises(ValueError, match=f"^onnx export: {message}, "):
        check_float32_quantize(model)


def _shared(dtype=TensorProto.INT8, zero="init", extra=()):
    """Two DequantizeLinear nodes reading one codes initializer ``w`` (a Linear called
    twice); ``zero``: the zero point an initializer, a node's output, or none."""
    inits = [helper.make_tensor("w", dtype, [2], [1, 2]), _scalar("s", TensorProto.FLOAT, 0.5)]
    ins = ["w", "s"]
    nodes = [helper.make_node("Identity", ["x"], [name]) for name in extra]
    if zero == "init":
        inits.append(_scalar("z", dtype, 0))
        ins.append("z")
    elif zero == "node":
        nodes.append(helper.make_node("Constant", [], ["z"], value=_scalar("c", dtype, 0)))
        ins.append("z")
    nodes += [helper.make_node("DequantizeLinear", ins, [out]) for out in ("d1", "d2")]
    nodes.append(helper.make_node("Add", ["d1", "d2"], ["y"]))
    return _model(nodes, [("x", TensorProto.FLOAT)], inits)


def test_shared_uint8_codes_are_left_shared():
    """Only int8 codes are copied (ORT's s8 -> u8 conversion is what refuses a shared
    weight): two nodes reading uint8 codes load from the path, which the given ``proto``
    stands for (the path is not read)."""
    assert unshared_codes("m.onnx", _shared(TensorProto.UINT8)) == "m.onnx"


@pytest.mark.parametrize(("zero", "want"), [("none", ["w2", "s"]), ("node", ["w2", "s", "z"])])
def test_the_codes_are_copied_beside_a_zero_point_that_is_no_initializer(zero, want):
    """The second node reads a copy of the codes; a zero point it does not have, or one a
    node computes (no initializer to copy), is left as it is."""
    proto = onnx.load_from_string(unshared_codes("m.onnx", _shared(zero=zero)))
    d1, d2 = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert list(d1.input) == ["w", "s", "z"][:len(want)]
    assert [d2.input[0] != "w", *d2.input[1:]] == [True, *want[1:]]


def test_a_copys_name_is_taken_by_no_other_initializer_or_node_output():
    """The copies' names are new: none is an existing initializer's or a node output's (ONNX
    names each value once), however many of the names tried are taken."""
    model = _shared(extra=["d2/w_"])
    model.graph.initializer.append(helper.make_tensor("d2/w", TensorProto.INT8, [1], [0]))
    before = {t.name for t in model.graph.initializer} | \
        {o for n in model.graph.node for o in n.output}
    proto = onnx.load_from_string(unshared_codes("m.onnx", model))
    d2 = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"][1]
    names = [t.name for t in proto.graph.initializer]
    assert d2.input[0] not in before and d2.input[2] not in before
    assert len(names) == len(set(names)) == len(before & set(names)) + 2


class _Config:
    pass


@pytest.mark.parametrize("saved", [False, True])
def test_no_cache_turns_use_cache_off_and_restores_the_value_it_had(saved):
    config = _Config()
    config.use_cache = saved
    with onnx_trace.NoCache(types.SimpleNamespace(config=config)):
        assert config.use_cache is False
    assert config.use_cache is saved


@pytest.mark.parametrize("error", [OSError("disk full"), MemoryError("out of memory")])
def test_the_machines_errors_pass_through_exporter_errors_as_they_came(error):
    with pytest.raises(type(error)) as got, onnx_trace.exporter_errors(nn.Linear(2, 2)):
        raise error
    assert got.value is error


def test_the_root_cause_follows_an_implicit_context_and_keeps_200_characters():
    """An error raised while handling another (no ``from``) has that one as its cause; the
    first line is cut at 200 characters."""
    try:
        try:
            raise KeyError("x")
        except KeyError:
            raise ValueError("a" * 250) from None
    except ValueError:
        try:
            raise RuntimeError("banner")
        except RuntimeError as outer:
            assert onnx_trace._root_cause(outer) == "ValueError: " + "a" * 200


def test_the_root_cause_of_an_error_without_a_message_is_its_type():
    assert onnx_trace._root_cause(RuntimeError()) == "RuntimeError"


def test_each_example_tensor_with_a_size_0_or_1_is_named():
    """Size 0 as well as 1, in a 1-d tensor too, every such tensor named (``; `` between)."""
    with pytest.warns(UserWarning) as got:
        onnx_trace.warn_specialized({"x": torch.ones(0, 3), "v": torch.ones(1),
                                     "ok": torch.ones(2, 2)})
    assert len(got) == 1
    assert "size 0 or 1 in example_inputs['x'] (0, 3) dimension [0]; example_inputs['v'] " \
           "(1,) dimension [0]: torch.export" in str(got[0].message)


class _Node:
    def __init__(self, op_type, domain="", producer=None):
        self.op_type, self.domain = op_type, domain
        self.inputs = [None if producer is None else types.SimpleNamespace(
            producer=lambda: producer)]


def test_optimize_holds_only_a_gemms_default_domain_batchnorm_apart():
    """While torch.onnx optimizes, a BatchNormalization after a Gemm is in the helper domain
    (no rule folds it); one after a Conv, one reading a graph input, one of another domain
    are not; afterwards each is back in its domain and the helper opset is gone, after a
    failing optimizer too."""
    gemm, conv = _Node("Gemm"), _Node("Conv")
    nodes = [gemm, conv, _Node("BatchNormalization", producer=gemm),
             _Node("BatchNormalization", producer=conv), _Node("BatchNormalization"),
             _Node("BatchNormalization", "custom", producer=gemm)]
    nodes[4].inputs = [types.SimpleNamespace(producer=lambda: None)]
    model = types.SimpleNamespace(graph=nodes, opset_imports={"": 21})
    seen = []

    def run():
        seen.append([n.domain for n in nodes[2:]])
        raise RuntimeError("optimizer failed")

    with pytest.raises(RuntimeError, match="optimizer failed"):
        onnx_trace.optimize(types.SimpleNamespace(model=model, optimize=run))
    assert seen == [[onnx_trace._HELD, "", "", "custom"]]
    assert [n.domain for n in nodes[2:]] == ["", "", "", "custom"]
    assert model.opset_imports == {"": 21}
