"""Pins of the writers' behaviour that no test held (mutation probe s63): each test fails on
one mutant of src/quantscope/exporters that the export tests let through. Expected values
come from the definitions (the docstrings' promises, the ONNX spec, compressed-tensors)."""

import pytest
import torch

from quantscope.layout import Tensor
from quantscope.qparams import QParams
from quantscope.spec import QuantSpec


def test_a_scale_the_half_dtype_overflows_to_inf_is_refused_even_when_lossy():
    """``_cast``: a value the model's dtype turns into 0 *or inf* is refused even under
    ``allow_lossy`` (float16 holds at most 65504: 1e5 becomes inf, a scale no runtime can
    divide by), never written with a rounding note."""
    from quantscope.exporters.compressed_tensors import _cast, _Lossy

    lossy = _Lossy(True)
    with pytest.raises(ValueError, match=r"weight_scale holds 100000\.0, which is inf in "
                                         r"torch\.float16"):
        _cast(torch.tensor([1.0, 1e5]), torch.float16, lossy, "l", "weight", "weight_scale")
    assert lossy.notes == []


def _kv_state(observer: str):
    spec = QuantSpec("fp8_e4m3", Tensor())
    return _role_state(spec, observer, QParams(torch.tensor(0.5), torch.tensor(0.0)))


def _role_state(spec, observer, qparams):
    from quantscope.calibration.results.role_state import RoleState

    return RoleState(spec, observer, observer, qparams=qparams)


def test_kv_roles_of_two_schemes_are_refused_not_written_as_the_first():
    """A checkpoint holds one ``kv_cache_scheme``: key and value roles whose compressed-tensors
    args differ (here only their observer) are refused, not written as one of the two."""
    pytest.importorskip("compressed_tensors")
    from quantscope.exporters.compressed_tensors import _kv_args, _Lossy

    kv = {"model.layers.0.self_attn": {"key": _kv_state("minmax"), "value": _kv_state("mse")}}
    with pytest.raises(ValueError, match=r"the KV cache roles differ in scheme \(2 kinds\)"):
        _kv_args(kv, _Lossy(False))


def test_uint8_storage_moves_codes_and_zero_point_by_exactly_128():
    """``uint8=True``: int8 codes and zero points both move by +128 into uint8, so ONNX's
    ``DequantizeLinear`` ``(q - zp) * scale`` runs the same values (an export's end-to-end
    tolerance let a zero point one off through); an input's zero point moves alone."""
    pytest.importorskip("onnx")
    from onnx import TensorProto

    from quantscope.exporters.onnx_graph import unsigned

    codes = torch.tensor([[-128, -1, 0, 127], [5, -7, 100, -100]], dtype=torch.int32)
    zp = torch.tensor([[0], [-3]], dtype=torch.int32)
    dtype, shifted, zp8 = unsigned(TensorProto.INT8, codes, zp, True)
    assert dtype == TensorProto.UINT8
    assert torch.equal(zp8, zp + 128) and torch.equal(shifted, codes + 128)
    assert torch.equal(shifted - zp8, codes - zp)
    assert int(shifted.min()) >= 0 and int(shifted.max()) <= 255
    dtype, none, input_zp = unsigned(TensorProto.INT8, None, torch.tensor(-5), True)
    assert (dtype, none, int(input_zp)) == (TensorProto.UINT8, None, 123)
    assert unsigned(TensorProto.INT8, codes, zp, False) == (TensorProto.INT8, codes, zp)


def test_an_int4_static_input_has_no_quantize_linear_form():
    """A static input exports only with a full int8 / uint8 / int16 range
    (``_input_storage``): a 4-bit input is refused before the trace, even though its codes
    [-8, 7] fill ONNX's INT4 type."""
    pytest.importorskip("onnx")
    from onnx import TensorProto

    from quantscope.exporters.onnx_graph import check_spec

    assert check_spec(QuantSpec("int8", Tensor()), "l", "input") == TensorProto.INT8
    with pytest.raises(ValueError, match=r"l\.input: codes \[-8, 7\] are not a full int8 / "
                                         r"uint8 / int16 range"):
        check_spec(QuantSpec("int4", Tensor()), "l", "input")


@pytest.mark.parametrize("preset", ["NVFP4", "MXFP4"])
def test_fp4_weight_args_carry_compressed_tensors_scale_and_zero_point_dtypes(preset):
    """The fp4 weight args quantscope writes hold the ``scale_dtype`` and ``zp_dtype`` of
    compressed-tensors' own preset scheme (NVFP4: float8 e4m3 both; MXFP4: uint8 both), the
    values its loaders and vLLM compare a config group with."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from quantscope import presets
    from quantscope.exporters.compressed_tensors import quant_args

    spec = getattr(presets, preset)
    args = quant_args(_role_state(spec, "minmax", None), "l", "weight")
    theirs = PRESET_SCHEMES[preset]["weights"]
    assert (args.scale_dtype, args.zp_dtype) == (theirs.scale_dtype, theirs.zp_dtype)


def test_a_local_nvfp4_input_keeps_its_observer_in_the_args():
    """``dynamic="local"`` (NVFP4 activations: a calibrated global scale, block scales at run
    time) records the observer that calibrated the global amax, as a static role does
    (compressed-tensors' own NVFP4 preset names one for its input): not the args' default."""
    pytest.importorskip("compressed_tensors")
    from dataclasses import replace

    from quantscope.exporters.compressed_tensors import quant_args
    from quantscope.presets import NVFP4

    state = replace(_role_state(NVFP4, "mse", None), dynamic="local",
                    global_amax=torch.tensor(3.0))
    args = quant_args(state, "l", "input")
    assert args.dynamic == "local" and args.observer == "mse"


@pytest.mark.parametrize("attribute", ["alpha", "beta"])
def test_a_scaled_gemm_is_not_rewritten_as_a_plain_matmul(attribute):
    """Only a ``Gemm`` computing ``A @ B + C`` (alpha = beta = 1, A not transposed) is
    rewritten as ``MatMul`` + ``Add``: one with another alpha or beta would lose its factor."""
    onnx = pytest.importorskip("onnx")
    from quantscope.exporters.onnx_graph import _plain_gemm

    plain = onnx.helper.make_node("Gemm", ["a", "b", "c"], ["y"], alpha=1.0, beta=1.0)
    scaled = onnx.helper.make_node("Gemm", ["a", "b", "c"], ["y"], **{attribute: 0.5})
    assert _plain_gemm(plain) and not _plain_gemm(scaled)


def test_a_bf16_output_of_the_float32_copy_is_declared_float32():
    """``float32_graph``: the graph of a bf16 model's float32 copy declares float32 where the
    forward's own casts said bf16: the casts, the outputs (ORT checks an output's declared
    type against what the graph computes) and no bf16 value_info left."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from quantscope.exporters.onnx_tensors import float32_graph

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.BFLOAT16),
         helper.make_node("Relu", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])],
        value_info=[helper.make_tensor_value_info("h", TensorProto.BFLOAT16, [2])])
    float32_graph(graph)
    assert graph.node[0].attribute[0].i == TensorProto.FLOAT
    assert graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert len(graph.value_info) == 0
    onnx.checker.check_graph(graph)


def test_a_shard_size_in_kb_is_read_in_thousands_of_bytes_as_huggingface_hub_reads_it():
    """``max_shard_size`` units are huggingface_hub's decimal ones (``parse_size_to_int``:
    ``KB`` = 10**3 bytes, the value's int): ``"0.000999KB"`` is 0 bytes there, refused as
    below one byte; ``"0.001KB"`` is one byte, taken."""
    from quantscope.exporters.ct_compress import check_shard_size

    check_shard_size("0.001KB", "export")
    with pytest.raises(ValueError, match=r"export: max_shard_size must be a size of at least "
                                         r"one byte.*got '0\.000999KB'"):
        check_shard_size("0.000999KB", "export")


@pytest.mark.parametrize(("count", "nbytes"), [(1, 1), (3, 2), (2047, 1024), (2048, 1024)])
def test_the_raw_size_of_int4_codes_rounds_a_half_byte_up(count, nbytes):
    """``_raw_size`` (what the external-data threshold and the 2 GiB bound read, without
    copying ``raw_data``) is the bytes ONNX stores: two 4-bit codes a byte, an odd count's
    last nibble in a byte of its own: ``ceil(count / 2)``, equal to ``len(raw_data)``."""
    pytest.importorskip("onnx")
    from onnx import TensorProto

    from quantscope.exporters.onnx_external import _raw_size
    from quantscope.exporters.onnx_tensors import code_tensor

    tensor = code_tensor("w", TensorProto.INT4, torch.zeros(count, dtype=torch.int8))
    assert _raw_size(tensor) == len(tensor.raw_data) == nbytes


@pytest.mark.parametrize("where", ["sub/../w.data", "sub\\..\\w.data", "sub/../../w.data"])
def test_a_location_naming_a_parent_anywhere_in_it_is_refused(tmp_path, where):
    """An external tensor's ``location`` holds no ``..`` anywhere (onnx_locations' module doc:
    "no absolute path, drive, ``..``"), not only as its first part: ``sub/../w.data`` is
    refused as such even where it resolves to a file inside the model's folder."""
    from quantscope.exporters.onnx_locations import _bad_location

    (tmp_path / "sub").mkdir()
    (tmp_path / "w.data").write_bytes(b"\0" * 8)
    assert _bad_location("w.data", str(tmp_path)) is None
    assert _bad_location(where, str(tmp_path)) == "leads out of the model's folder (..)"


def test_an_output_beside_an_input_whose_name_it_begins_is_not_refused(tmp_path):
    """The output guard refuses an output that is, or lies above, an input: a sibling whose
    name merely starts with the output's (``out2`` beside ``out``) lies in no output folder,
    so writing ``out`` replaces nothing of it."""
    from quantscope.exporters.atomic import check_writable_target

    (tmp_path / "out2").mkdir()
    got = check_writable_target(tmp_path / "out", inputs=[tmp_path / "out2"])
    assert got == str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"contains the input"):
        check_writable_target(tmp_path / "out", inputs=[tmp_path / "out" / "x"])


@pytest.mark.parametrize("smoothing", [{"model.layers.0.mlp": "smooth"}, {}])
def test_the_exports_record_says_whether_the_calibration_was_smoothed(tmp_path, smoothing):
    """``config.json``'s ``quantscope`` record (``annotate``) holds the recipe, label, lossy
    notes, source model and ``smoothed``: whether the calibration smoothed the model."""
    import json
    from types import SimpleNamespace

    from torch import nn

    from quantscope.exporters.ct_compress import annotate

    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"config_groups": {}, "ignore": []}}))
    calibration = SimpleNamespace(recipe=SimpleNamespace(name="w8a8"), label="run",
                                  smoothing=smoothing)
    annotate(str(tmp_path), calibration, ["a note"], "/models/src", nn.Linear(2, 2))
    record = json.loads((tmp_path / "config.json").read_text())["quantscope"]
    assert record == {"recipe": "w8a8", "label": "run", "lossy": ["a note"],
                      "model": "/models/src", "smoothed": bool(smoothing)}


def test_an_existing_empty_folder_is_written_into_without_overwrite(tmp_path):
    """An empty folder holds nothing to lose (``_check_replaceable``): an output may be an
    existing empty folder that quantscope did not make, with no ``overwrite``."""
    from quantscope.exporters.atomic import atomic_dir, check_writable_target

    (tmp_path / "empty").mkdir()
    assert check_writable_target(tmp_path / "empty") == str(tmp_path / "empty")
    with atomic_dir(tmp_path / "empty") as tmp, open(f"{tmp}/f.txt", "w") as f:
        f.write("x")
    assert (tmp_path / "empty" / "f.txt").read_text() == "x"


def test_int_weights_with_a_dynamic_int4_input_are_served_as_wna4():
    """vLLM's WNA4 scheme serves packed int weights per channel or group with a dynamic
    symmetric int4 input per token or group (``_int``: "WNA8 / WNA4 int"), so no refusal."""
    from quantscope.exporters.serving import vllm_refusal

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 128, "dynamic": False}
    inputs = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "token",
              "dynamic": True}
    assert vllm_refusal(weights, inputs, "pack-quantized") is None
    assert vllm_refusal(weights, dict(inputs, num_bits=2), "pack-quantized") is not None


@pytest.mark.parametrize("err", ["ENOSYS", "EINVAL", "ENOTSUP"])
def test_renameat2_a_file_system_lacks_falls_back_to_the_locked_swap(monkeypatch, err):
    """``_renameat2`` says False (the caller then swaps under the parent's lock) where the
    system or file system lacks the call or its flag: renameat2(2) fails with ENOSYS, or
    EINVAL for a flag the file system does not support (RENAME_EXCHANGE on some of them),
    or ENOTSUP; another errno is an OSError."""
    import errno
    from types import SimpleNamespace

    from quantscope.exporters import atomic_swap

    lib = SimpleNamespace(renameat2=lambda *args: -1)
    monkeypatch.setattr(atomic_swap.ctypes, "CDLL", lambda *args, **kwargs: lib)
    monkeypatch.setattr(atomic_swap.ctypes, "get_errno", lambda: getattr(errno, err))
    assert atomic_swap._renameat2("a", "b", atomic_swap._RENAME_EXCHANGE) is False
    monkeypatch.setattr(atomic_swap.ctypes, "get_errno", lambda: errno.EACCES)
    with pytest.raises(PermissionError):
        atomic_swap._renameat2("a", "b", atomic_swap._RENAME_EXCHANGE)


def test_an_initializer_the_graph_outputs_is_kept_when_no_node_reads_it():
    """``drop_unused_initializers`` drops only what nothing uses: a float weight the DQ nodes
    replaced goes, but an initializer that is itself a graph output (a forward returning a
    buffer) stays, or the model would name an output no tensor holds."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from quantscope.exporters.onnx_graph import drop_unused_initializers

    inits = [numpy_helper.from_array(torch.ones(2).numpy(), name) for name in ("w", "c", "old")]
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("y", "c")],
        initializer=inits)
    drop_unused_initializers(graph)
    assert [t.name for t in graph.initializer] == ["w", "c"]
    onnx.checker.check_graph(graph)
