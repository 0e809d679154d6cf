"""Pins of src/quantscope/exporters/onnx_external.py that no test held (mutation round s69):
each test fails on a mutant the existing tests let through: the 2 GiB bound counting every
field protobuf writes, the checks write_model itself runs (a link to another folder, the
float32 check of both paths), the data file named after the file written, which tensors go
to it, the replaced export's data file (left where it is no plain file named exactly as the
export names its own), the reuse check of a data file, and the refusal naming what is at its
name. Expected values come from the module doc, the docstrings, docs/guide/deploy.md and
protobuf's wire format."""

import hashlib
import os
import socket

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import TensorProto, numpy_helper
from test_onnx_external_data import _marked
from test_onnx_external_probe_s49 import _external_tensor
from test_onnx_tensors_pins_s65 import _quantize_graph

from quantscope.exporters import onnx_external
from quantscope.exporters.onnx_external import (
    SIZE_THRESHOLD,
    _same_bytes,
    _what_is,
    _write_data,
    graph_bytes,
    write_model,
)


def _empty_graph():
    model = onnx.ModelProto()
    model.graph.SetInParent()  # written: its tag and a zero length
    return model


def _plain_tensors():
    """100 initializers holding their value in ``float_data`` (no raw data): protobuf writes
    each one's tag and length beside it."""
    model = _empty_graph()
    for _ in range(100):
        model.graph.initializer.add(float_data=[1.0])
    return model


def _non_ascii_doc():
    model = _empty_graph()
    model.doc_string = "\u00e9" * 1000  # 2000 bytes in UTF-8
    return model


@pytest.mark.parametrize("make", [_empty_graph, _plain_tensors, _non_ascii_doc],
                         ids=["graph_tag", "tensor_tags", "utf8_string"])
def test_the_size_bound_is_never_below_what_protobuf_writes(make):
    """graph_bytes is an upper bound of the serialized model: the graph's own tag and length,
    each initializer's, and a string's UTF-8 bytes (not its characters) are counted."""
    model = make()
    assert graph_bytes(model) >= len(model.SerializeToString())


def test_the_size_bound_counts_only_the_fields_written():
    """Each field present counts 12 bytes beside its value; an unset field is not written
    and counts nothing: a model holding an empty graph is bounded by the graph's 12."""
    assert graph_bytes(_empty_graph()) == 12


def _write(path, tensors):
    write_model(onnx, _marked(tensors), str(path), external=True, overwrite=False, inputs=())


def _big(name="w"):
    return numpy_helper.from_array(np.arange(SIZE_THRESHOLD, dtype=np.uint8), name)


def test_write_model_refuses_a_link_to_a_file_in_another_folder(tmp_path):
    """With the default external_data=None the export knows it goes external only after the
    trace, and write_model checks the target itself: a link to another folder's file is
    refused (the data file would not lie beside the path opened), nothing written."""
    (tmp_path / "real").mkdir()
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "real" / "m.onnx", tmp_path / "out" / "latest.onnx")
    with pytest.raises(ValueError, match="symbolic link to .*in another folder"):
        _write(tmp_path / "out" / "latest.onnx", [_big()])
    assert os.listdir(tmp_path / "real") == []


def test_the_data_file_is_named_after_the_file_written_not_the_link(tmp_path):
    """Through a link in the model's folder the file written is the link's target, and the
    data file is ``<that name>.<16 hex digits>.data``."""
    os.symlink("m.onnx", tmp_path / "latest.onnx")
    _write(tmp_path / "latest.onnx", [_big()])
    (data,) = [n for n in os.listdir(tmp_path) if n.endswith(".data")]
    digest = hashlib.sha256((tmp_path / data).read_bytes()).hexdigest()
    assert data == f"m.onnx.{digest[:16]}.data"


@pytest.mark.parametrize("external", [False, True], ids=["one_file", "external"])
def test_write_model_refuses_a_float64_quantize_linear_and_writes_nothing(tmp_path,
                                                                        external):
    """The checker passes a QuantizeLinear reading float64, ONNX Runtime refuses it: both
    ways of writing refuse it (check_float32_quantize), leaving no file."""
    with pytest.raises(ValueError, match="fc: QuantizeLinear reads 'x' as double"):
        write_model(onnx, _quantize_graph(TensorProto.DOUBLE), str(tmp_path / "m.onnx"),
                    external=external, overwrite=False, inputs=())
    assert os.listdir(tmp_path) == []


def test_a_raw_tensor_of_a_type_without_a_known_size_goes_by_its_bytes(tmp_path):
    """A ``raw_data`` tensor whose element size is not known (a type number onnx does not
    define) is sent to the data file by its bytes: SIZE_THRESHOLD of them go, one fewer
    stays."""
    model = _marked()
    for name, n in (("at", SIZE_THRESHOLD), ("below", SIZE_THRESHOLD - 1)):
        model.graph.initializer.add(name=name, data_type=999, dims=[n], raw_data=bytes(n))
    with open(tmp_path / "d", "wb") as f:
        _, written = _write_data(model, f)
    assert [(t.name, offset, length) for t, offset, length in written] == [
        ("at", 0, SIZE_THRESHOLD)]


def _replace(tmp_path, location, make=None):
    """A quantscope model in ``tmp_path`` whose one external tensor names ``location`` (None:
    no location entry) where ``make`` put something, replaced by a one-file export."""
    entries = [("offset", "0"), ("length", "16")]
    if location is not None:
        entries.insert(0, ("location", location))
        make(tmp_path / location)
    old = _marked([_external_tensor(entries)])
    old.doc_string = "location"  # parsed for its locations: the bytes occur in the file
    (tmp_path / "m.onnx").write_bytes(old.SerializeToString())
    write_model(onnx, _marked(), str(tmp_path / "m.onnx"), external=False, overwrite=True,
                inputs=())
    assert onnx.load(str(tmp_path / "m.onnx")) == _marked()


@pytest.mark.parametrize("location", ["m.onnx.0123456789abcdeg.data",
                                      "mXonnx.0123456789abcdef.data"],
                         ids=["not_hex", "other_model"])
def test_overwrite_keeps_a_file_named_only_nearly_as_its_data_file(tmp_path, location):
    """Only ``<model name>.<16 hex digits>.data`` exactly is the replaced export's own data
    file: a non-hex digit, or another character where the model name has its dot, is
    kept."""
    _replace(tmp_path, location, lambda p: p.write_bytes(bytes(16)))
    assert (tmp_path / location).read_bytes() == bytes(16)


def test_overwrite_keeps_a_folder_at_the_data_files_name(tmp_path):
    """The replaced export's data file is deleted only where it is a plain file: a folder at
    its very name is left, and the export still succeeds."""
    location = "m.onnx.0123456789abcdef.data"
    _replace(tmp_path, location, os.mkdir)
    assert os.path.isdir(tmp_path / location)


def test_overwrite_of_a_model_whose_tensor_names_no_location(tmp_path):
    """An external tensor without a ``location`` entry names no data file of the export's:
    the model is replaced, nothing else happens (no error)."""
    _replace(tmp_path, None)
    assert os.listdir(tmp_path) == ["m.onnx"]


def test_the_reuse_check_hashes_every_chunk(tmp_path, monkeypatch):
    """_same_bytes reads the file in chunks of _CHUNK bytes and hashes them all: a file
    longer than one chunk matches the digest of all its bytes."""
    monkeypatch.setattr(onnx_external, "_CHUNK", 4)
    (tmp_path / "f").write_bytes(b"0123456789")
    assert _same_bytes(str(tmp_path / "f"), hashlib.sha256(b"0123456789").hexdigest())
    assert not _same_bytes(str(tmp_path / "f"), hashlib.sha256(b"0123").hexdigest())


def test_nothing_at_the_data_files_name_is_not_the_same_bytes(tmp_path):
    """A path gone meanwhile is not a file of these bytes: False, not an OSError."""
    assert _same_bytes(str(tmp_path / "gone"), hashlib.sha256(b"").hexdigest()) is False


def test_the_refusal_names_a_socket_or_a_device(tmp_path):
    """_what_is (the refusal's words for what is at the data file's name): a socket is
    named a socket, a character device a device."""
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert _what_is(str(path)) == "a socket"
    assert _what_is(os.devnull) == "a device"
