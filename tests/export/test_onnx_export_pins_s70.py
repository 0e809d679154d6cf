"""Pins of ``exporters/onnx.py`` from a mutation round (s70): behaviours no earlier test held,
each checked against the module's docstrings and ONNX Runtime's session options: the
``example_inputs`` kinds and unknown options refused, ``external_data`` checked as a flag
before the trace, a meta tensor and a data file's long name refused up front, the session's
inter-op threads, AMX counted as an exact int8 kernel, the kernel counts reading no data file,
the size estimate and protobuf's limit, the folders a model was loaded from, and the defaults
(opset 21, int8 storage) the export passes on; and, from a second pass over the mutants the
first left unrun: a weight of another shape than calibrated refused, ONNX Runtime's per-group
refusal only where weight and static input are both 8-bit, and a biased QDQ MatMul on a 2-D
input kept an integer kernel (MatMulAddFusion disabled)."""

import types

import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from test_onnx_pins_s65 import _Mlp
from test_onnx_s38 import _recipe, no_trace  # noqa: F401 (the fixture)

from quantscope import Channel, Group, QuantSpec, Tensor, calibrate, export
from quantscope.exporters import onnx as qonnx


def _small():
    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2, 3, 32)
    return model, x, calibrate(model, [x], _recipe(QuantSpec("int8", Channel(0))),
                               progress=False)


@pytest.mark.parametrize("example", [3, "x", {1, 2}])
def test_example_inputs_of_another_kind_are_a_type_error(example):
    """A tensor, a tuple / list of tensors or a dict of keyword tensors; anything else is a
    ``TypeError`` naming its type, before the exporter runs."""
    with pytest.raises(TypeError, match=rf"example_inputs must be a tensor.*got "
                                        rf"{type(example).__name__}"):
        qonnx._export_float(nn.Linear(4, 4), example, 21)


@pytest.mark.usefixtures("no_trace")
def test_an_unknown_option_is_refused_before_the_trace(tmp_path):
    model, x, calib = _small()
    with pytest.raises(ValueError, match=r"onnx export: unknown options \['bits', 'scale'\]"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x,
               scale=1, bits=8)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.usefixtures("no_trace")
@pytest.mark.parametrize("flag", ["no", 0, 1])
def test_a_non_bool_external_data_is_refused_before_the_trace(tmp_path, flag):
    """``external_data`` is None, True or False (``bool("no")`` is True)."""
    model, x, calib = _small()
    with pytest.raises(ValueError, match=r"onnx export: external_data must be True or False"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x,
               external_data=flag)
    assert not (tmp_path / "m.onnx").exists()


def test_session_options_run_one_inter_op_thread_beside_the_given_intra_op_threads():
    so = qonnx.session_options(threads=3)
    assert (so.intra_op_num_threads, so.inter_op_num_threads) == (3, 1)


def test_an_x86_cpu_with_amx_int8_has_an_exact_int8_kernel(tmp_path, monkeypatch):
    """AMX's int8 tile products sum in int32, as VNNI's do."""
    import platform
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_int8\n")
    assert qonnx.int8_dot_product(str(tmp_path / "cpuinfo")) is True


def test_kernel_counts_read_the_graph_alone_and_tell_integer_kernels_from_float(tmp_path):
    h, TP = onnx.helper, onnx.TensorProto
    weight = onnx.numpy_helper.from_array(torch.ones(64, 64).numpy(), "w")
    nodes = [h.make_node("MatMulNBits", ["x", "w"], ["a"], domain="com.microsoft"),
             h.make_node("QGemm", ["a", "w"], ["q"], domain="com.microsoft"),
             h.make_node("Gemm", ["q", "w"], ["b"]), h.make_node("Relu", ["b"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [1, 64])],
                         [h.make_tensor_value_info("y", TP.FLOAT, [1, 64])], [weight])
    onnx.save_model(h.make_model(graph), str(tmp_path / "o.onnx"), save_as_external_data=True,
                    location="o.data", size_threshold=0)
    (tmp_path / "o.data").unlink()
    counts = qonnx.integer_kernel_counts(tmp_path / "o.onnx")
    assert counts == {"MatMulNBits": 1, "QGemm": 1, "Gemm": 1}
    # ORT's quantized Gemm is an integer kernel, the float Gemm left is not
    assert {op for op in counts if op in qonnx.INTEGER_KERNELS} == {"MatMulNBits", "QGemm"}


def test_the_model_folders_are_the_calibrations_record_and_the_configs_name(tmp_path):
    """Folders only: a name that is a file, or no folder at all, is left out."""
    first, second, file = tmp_path / "a", tmp_path / "b", tmp_path / "f.bin"
    first.mkdir(), second.mkdir(), file.write_bytes(b"")
    calib = types.SimpleNamespace(info={"model": str(first)})

    def model(name):
        return types.SimpleNamespace(config=types.SimpleNamespace(_name_or_path=name))

    assert qonnx._model_folders(calib, model(second)) == [str(first), str(second)]
    assert qonnx._model_folders(calib, model(str(file))) == [str(first)]
    assert qonnx._model_folders(types.SimpleNamespace(info=None), model(file)) == []


@pytest.mark.usefixtures("no_trace")
def test_a_missing_example_inputs_is_refused_before_the_trace(tmp_path):
    model, _, calib = _small()
    with pytest.raises(ValueError, match=r"onnx export: example_inputs is required"):
        export(calib, model, tmp_path / "m.onnx", format="onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_the_size_estimate_counts_a_one_byte_integer_buffer_as_one_byte():
    """Float tensors as float32, integer ones as they are (a bool mask: one byte a value)."""
    model, _, calib = _small()
    model.register_buffer("mask", torch.ones(1000, dtype=torch.bool))
    codes, floats = 32 * 32 + 16 * 32, 32 + 16  # int8 weights, float32 biases
    assert qonnx._estimated_bytes(model, calib.states) == codes + floats * 4 + 1000


def test_the_protobuf_limit_is_protobufs_2_gib_less_one_byte():
    """Protobuf's messages are bounded by a signed 32-bit size: 2 ** 31 - 1 bytes pass."""
    qonnx._check_size(2 ** 31 - 1, "in the graph")
    with pytest.raises(ValueError, match=r"take 2147483648 bytes"):
        qonnx._check_size(2 ** 31, "in the graph")


@pytest.mark.usefixtures("no_trace")
def test_a_name_too_long_for_a_data_file_is_refused_only_for_external_data(tmp_path):
    """``external_data=True`` checks the data file's name before the trace; ``False`` writes
    no data file, and goes on to the trace (the fixture's AssertionError)."""
    model, x, calib = _small()
    path = tmp_path / ("m" * 240 + ".onnx")
    with pytest.raises(ValueError, match=r"its data file's name would be 267 bytes"):
        export(calib, model, path, format="onnx", example_inputs=x, external_data=True)
    with pytest.raises(AssertionError, match=r"the model was traced"):
        export(calib, model, path, format="onnx", example_inputs=x, external_data=False)


class _Traced(Exception):
    pass


def test_the_default_opset_given_to_the_trace_is_21(tmp_path, monkeypatch):
    """The lowest opset with int4 and ``block_size``, as the signature says."""
    seen = []

    def traced(model, example_inputs, opset, states=None):
        seen.append(opset)
        raise _Traced

    monkeypatch.setattr(qonnx, "_export_float", traced)
    model, x, calib = _small()
    with pytest.raises(_Traced):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert seen == [21]


@pytest.mark.usefixtures("no_trace")
def test_a_tensor_on_the_meta_device_is_refused_before_the_trace(tmp_path):
    """A graph needs every tensor's values: a meta buffer is named, nothing is written."""
    model, x, calib = _small()
    model.register_buffer("ghost", torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"onnx export: 'ghost' is on the meta device"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert not (tmp_path / "m.onnx").exists()


def test_int8_codes_are_stored_as_int8_by_default(tmp_path, monkeypatch):
    """``uint8=False`` is the default: the graph writer is asked for int8 storage."""
    seen = []

    def insert_qdq(onnx_module, graph, model, states, uint8, opset):
        seen.append(uint8)
        raise _Traced

    monkeypatch.setattr(qonnx, "_export_float", lambda *a, **k: types.SimpleNamespace(graph=None))
    monkeypatch.setattr(qonnx, "insert_qdq", insert_qdq)
    model, x, calib = _small()
    with pytest.raises(_Traced):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert seen == [False]


def test_a_weight_of_another_shape_than_calibrated_is_refused_as_another_models():
    model, _, calib = _small()
    model.a = nn.Linear(16, 32)
    with pytest.raises(ValueError, match=r"onnx export: a\.weight has shape \(32, 16\), but "
                                         r"was calibrated with shape \(32, 32\)"):
        qonnx.check_exportable(calib.states, model)


def test_8_bit_weight_groups_with_a_16_bit_static_input_are_not_refused():
    """ORT runs per-group int8 weights beside a 16-bit input (only 8 + 8 bits fuse)."""
    roles = {"weight": types.SimpleNamespace(spec=QuantSpec("int8", Group(32))),
             "input": types.SimpleNamespace(spec=QuantSpec("int16", Tensor()))}
    qonnx._check_ort_runs("a", roles)
    roles["input"] = types.SimpleNamespace(spec=QuantSpec("int8", Tensor()))
    with pytest.raises(ValueError, match=r"onnx export: a: per-group weights"):
        qonnx._check_ort_runs("a", roles)


def test_a_biased_qdq_linear_on_a_2d_input_runs_as_an_integer_kernel(tmp_path):
    """MatMulAddFusion is off (``DISABLED_OPTIMIZERS``): ORT would otherwise fold a W8A8
    MatMul and its bias on a 2-D input into a ``Gemm`` before the QDQ fusions and run it in
    float; with it off the pair runs as an integer kernel."""
    h, tp = onnx.helper, onnx.TensorProto
    init = [h.make_tensor("xs", tp.FLOAT, [], [0.05]), h.make_tensor("xz", tp.INT8, [], [0]),
            h.make_tensor("w", tp.INT8, [32, 16], [(i * 7) % 255 - 127 for i in range(512)]),
            h.make_tensor("ws", tp.FLOAT, [16], [0.01] * 16),
            h.make_tensor("wz", tp.INT8, [16], [0] * 16),
            h.make_tensor("b", tp.FLOAT, [16], [0.5] * 16)]
    nodes = [h.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             h.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             h.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=1),
             h.make_node("MatMul", ["xd", "wd"], ["m"]),
             h.make_node("Add", ["m", "b"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", tp.FLOAT, [4, 32])],
                         [h.make_tensor_value_info("y", tp.FLOAT, [4, 16])], init)
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]),
              str(tmp_path / "m.onnx"))
    qonnx.session(tmp_path / "m.onnx", threads=1, optimized_model_path=str(tmp_path / "o.onnx"))
    counts = qonnx.integer_kernel_counts(tmp_path / "o.onnx")
    assert sum(counts.get(k, 0) for k in qonnx.INTEGER_KERNELS) == 1, counts
    assert not any("Gemm" in k and k != "QGemm" for k in counts), counts
