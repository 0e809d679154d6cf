"""Pins of where an ONNX export's tensors go and how their locations are checked that no test
held (mutation round s66): each test fails on one mutant of
src/quantscope/exporters/onnx_locations.py or onnx_external.py (the location check, the
optimized model's targets, the data file's name, placement and reuse, the replaced export's
data file, the size bound and the session entries) that the existing tests let through.
Expected values come from the definitions: the module docs and docstrings, docs/SECURITY.md,
docs/guide/deploy.md and the ONNX spec's element sizes."""

import hashlib
import os
import stat

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import TensorProto, helper, numpy_helper
from test_onnx_external_data import _marked
from test_onnx_external_probe_s49 import _external_tensor, _in_graph

from quantscope.exporters import onnx_external
from quantscope.exporters.onnx_external import (
    SIZE_THRESHOLD,
    _raw_size,
    graph_bytes,
    session_entries,
    write_model,
)
from quantscope.exporters.onnx_locations import check_optimized, read_graph

W16 = [("location", "w.bin"), ("offset", "0"), ("length", "16")]


def _folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.bin").write_bytes(bytes(16))
    return folder


def test_an_empty_file_names_no_location_and_is_not_parsed(tmp_path):
    """read_graph: a file in which ``location`` occurs nowhere is ``(None, None)``; an empty
    one too (mmap cannot map it)."""
    (tmp_path / "empty.onnx").write_bytes(b"")
    assert read_graph(tmp_path / "empty.onnx") == (None, None)


def test_the_folder_read_graph_returns_is_absolute(tmp_path, monkeypatch):
    """The folder where the data files lie (ONNX Runtime's folder entry for a model given as
    bytes) is the model's folder made absolute, for a relative path too."""
    folder = _folder(tmp_path)
    _in_graph(folder, W16)
    monkeypatch.chdir(folder)
    assert read_graph("crafted.onnx")[1] == os.getcwd()


@pytest.mark.parametrize("entries", [[("offset", "0"), ("length", "16")],
                                     [("location", "w.bin\0x"), ("offset", "0")]],
                         ids=["no_location", "nul"])
def test_a_missing_location_or_one_holding_nul_is_refused_as_not_relative(tmp_path, entries):
    """An external tensor naming no location (an empty one), or one with a NUL byte, is a
    ValueError naming the rule: not a relative path (not a KeyError, nor the OS's error)."""
    path = _in_graph(_folder(tmp_path), entries)
    model = onnx.load(str(path), load_external_data=False)
    model.doc_string = "location"  # parsed: the bytes occur in the file
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ValueError, match=r"tensor 'w' has its data in .*, which is not a "
                                         r"relative path; "):
        read_graph(path)


@pytest.mark.parametrize(("length", "ok"), [("16", True), ("17", False)])
def test_a_location_without_an_offset_starts_at_the_files_first_byte(tmp_path, length, ok):
    """No ``offset`` entry: offset 0 (the ONNX spec), so a length of the whole file is read,
    one byte more is not."""
    folder = _folder(tmp_path)
    path = _in_graph(folder, [("location", "w.bin"), ("length", length)])
    if ok:
        assert read_graph(path)[1] == str(folder)
        return
    with pytest.raises(ValueError, match="offset None and length 17 lie outside its 16 bytes"):
        read_graph(path)


def test_a_model_opened_through_a_linked_folder_reads_its_data(tmp_path):
    """A folder link leading to the model's folder: the data file, no link, lies inside the
    folder the model is in (both resolved), and is read."""
    folder = _folder(tmp_path)
    _in_graph(folder, W16)
    os.symlink(folder, tmp_path / "linked")
    assert read_graph(tmp_path / "linked" / "crafted.onnx")[1] == str(tmp_path / "linked")


def test_a_one_file_models_optimized_path_leaves_a_data_name_beside_it_alone(tmp_path):
    """For a model without external data ORT writes ``opt`` alone: a file of the user's at
    ``opt.data`` is no target, not refused."""
    (tmp_path / "m.onnx").write_bytes(b"model")
    (tmp_path / "opt.onnx.data").write_bytes(b"mine")
    check_optimized(tmp_path / "m.onnx", None, None, tmp_path / "opt.onnx")
    assert (tmp_path / "opt.onnx.data").read_bytes() == b"mine"


@pytest.mark.parametrize("link", ["dangling", "to_earlier"])
def test_a_link_at_the_optimized_path_is_refused(tmp_path, link):
    """An earlier optimized model is a plain file: a symbolic link there (dangling, which ORT
    would write through, or to an earlier optimized model) is refused; the plain file the
    link named, put there instead, is replaced (no refusal)."""
    (tmp_path / "m.onnx").write_bytes(b"model")
    if link == "to_earlier":
        (tmp_path / "earlier.onnx").write_bytes(_marked().SerializeToString())
    os.symlink(tmp_path / "earlier.onnx", tmp_path / "opt.onnx")
    with pytest.raises(ValueError, match=r"opt\.onnx' exists and is not an earlier optimized"):
        check_optimized(tmp_path / "m.onnx", None, None, tmp_path / "opt.onnx")
    os.remove(tmp_path / "opt.onnx")
    (tmp_path / "opt.onnx").write_bytes(_marked().SerializeToString())
    check_optimized(tmp_path / "m.onnx", None, None, tmp_path / "opt.onnx")


def _tensor(dtype, count, raw=True):
    t = TensorProto(name="t", data_type=dtype, dims=[count])
    if raw:
        t.raw_data = b"\1" * ((count * _ONNX_BITS[TensorProto.DataType.Name(dtype)] + 7) // 8)
    return t


#: the ONNX spec's element sizes (bits) of the types a raw tensor holds
_ONNX_BITS = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4, "INT8": 8, "UINT8": 8, "BOOL": 8,
              "FLOAT8E4M3FN": 8, "FLOAT8E4M3FNUZ": 8, "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8,
              "FLOAT8E8M0": 8, "INT16": 16, "UINT16": 16, "FLOAT16": 16, "BFLOAT16": 16,
              "FLOAT": 32, "INT32": 32, "UINT32": 32, "DOUBLE": 64, "INT64": 64, "UINT64": 64,
              "COMPLEX64": 64, "COMPLEX128": 128}


@pytest.mark.parametrize("name", [n for n in _ONNX_BITS if hasattr(TensorProto, n)])
def test_the_raw_size_of_each_type_is_the_bytes_onnx_stores(name):
    """``_raw_size`` (the threshold's and the 2 GiB bound's size, read without copying
    ``raw_data``) is the element count times the type's ONNX size, rounded up to a byte."""
    dtype = TensorProto.DataType.Value(name)
    for count in (3, 1000):
        t = _tensor(dtype, count)
        assert _raw_size(t) == len(t.raw_data) == (count * _ONNX_BITS[name] + 7) // 8


def test_the_raw_size_is_none_without_raw_data_or_of_an_unknown_type():
    """None where the tensor has no ``raw_data`` (its values in ``float_data``), or a type
    number ONNX does not define (not a raise)."""
    t = helper.make_tensor("f", TensorProto.FLOAT, [4], [1.0] * 4)
    assert not t.HasField("raw_data") and _raw_size(t) is None
    assert _raw_size(TensorProto(name="u", data_type=999, dims=[4], raw_data=bytes(4))) is None


def test_the_size_bound_counts_each_tensors_name_and_dims():
    """graph_bytes is never below what protobuf writes: a raw tensor's other fields (a long
    name, many dims) are counted beside its bytes."""
    tensors = [TensorProto(name=f"{i}" * 3000, data_type=TensorProto.UINT8,
                           dims=[1] * 200 + [4], raw_data=bytes(4)) for i in range(3)]
    model = _marked(tensors)
    assert graph_bytes(model) >= len(model.SerializeToString())


def test_the_name_limit_is_the_nearest_existing_folders(tmp_path, monkeypatch):
    """check_external_target reads NAME_MAX of the file system the data file goes to: for an
    output in folders the export will make, that of the nearest folder that exists."""
    asked = []
    monkeypatch.setattr(onnx_external, "_name_max", lambda folder: asked.append(folder) or 255)
    onnx_external.check_external_target(tmp_path / "a" / "b" / "m.onnx")
    assert asked == [str(tmp_path)]


def test_the_data_file_is_written_under_a_temporary_name_in_the_models_folder(tmp_path,
                                                                               monkeypatch):
    """The data file is renamed to its name from a temporary file beside it (a rename in
    one folder: one file system, no copy)."""
    moved, real = [], onnx_external._renameat2

    def renameat2(src, dst, flags):
        moved.append((os.path.dirname(src), os.path.dirname(dst)))
        return real(src, dst, flags)

    monkeypatch.setattr(onnx_external, "_renameat2", renameat2)
    big = numpy_helper.from_array(np.arange(SIZE_THRESHOLD, dtype=np.uint8), "w")
    write_model(onnx, _marked([big]), str(tmp_path / "m.onnx"), external=True,
                overwrite=False, inputs=())
    assert moved == [(str(tmp_path), str(tmp_path))]


def test_the_data_files_name_is_the_sha256_of_all_its_bytes_padding_included(tmp_path):
    """``<model name>.<16 hex digits of its SHA-256>.data``: the digest of the file as
    written, the zeros aligning a 1 MiB tensor included."""
    arrays = [(np.arange(n) % 251).astype(np.uint8) for n in (SIZE_THRESHOLD, 1 << 20)]
    tensors = [numpy_helper.from_array(a, f"w{i}") for i, a in enumerate(arrays)]
    write_model(onnx, _marked(tensors), str(tmp_path / "m.onnx"), external=True,
                overwrite=False, inputs=())
    (data,) = [n for n in os.listdir(tmp_path) if n.endswith(".data")]
    body = (tmp_path / data).read_bytes()
    assert len(body) > SIZE_THRESHOLD + (1 << 20)  # the padding is there
    assert data == f"m.onnx.{hashlib.sha256(body).hexdigest()[:16]}.data"


@pytest.mark.parametrize("external", [False, True], ids=["one_file", "external"])
def test_a_model_the_checker_refuses_leaves_no_file(tmp_path, external):
    """write_model checks the model (one file: before anything is written; with external
    data: the written pair, on the path, before the swap); a refused one leaves nothing this
    export wrote: no model, no data file, no temporary."""
    big = numpy_helper.from_array(np.arange(SIZE_THRESHOLD, dtype=np.uint8), "w")
    model = _marked([big])
    model.graph.node[0].input[0] = "undefined"
    with pytest.raises(onnx.checker.ValidationError):
        write_model(onnx, model, str(tmp_path / "m.onnx"), external=external,
                    overwrite=False, inputs=())
    assert os.listdir(tmp_path) == []


def test_the_data_file_gets_the_modes_the_umask_gives(tmp_path):
    """The data file (made by tempfile, private) gets the modes of any file the user writes:
    0o644 under a 022 umask, as the model beside it."""
    big = numpy_helper.from_array(np.arange(SIZE_THRESHOLD, dtype=np.uint8), "w")
    old = os.umask(0o022)
    try:
        write_model(onnx, _marked([big]), str(tmp_path / "m.onnx"), external=True,
                    overwrite=False, inputs=())
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE((tmp_path / n).stat().st_mode) for n in os.listdir(tmp_path)}
    assert len(modes) == 2 and set(modes.values()) == {0o644}, modes


def test_an_identical_re_export_leaves_the_pair_alone(tmp_path):
    """Re-exporting the same model reuses its data file (the same bytes): the folder holds
    the model and that one data file, nothing else (no temporary left)."""
    big = numpy_helper.from_array(np.arange(SIZE_THRESHOLD, dtype=np.uint8), "w")
    for overwrite in (False, True):
        write_model(onnx, _marked([big]), str(tmp_path / "m.onnx"), external=True,
                    overwrite=overwrite, inputs=())
        names = sorted(os.listdir(tmp_path))
        assert len(names) == 2 and names[0] == "m.onnx" and names[1].endswith(".data"), names


def _digest(data):
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("locked", [False, True], ids=["renameat2", "locked"])
def test_a_link_at_the_data_files_name_is_refused_and_kept(tmp_path, monkeypatch, locked):
    """_place never replaces a file there nor reuses a link: a dangling link, or one to a file
    of the very same bytes, is refused as a symbolic link and left as it was."""
    if locked:
        monkeypatch.setattr(onnx_external, "_renameat2", lambda *a: False)
    final = tmp_path / "m.onnx.0123456789abcdef.data"
    for target in ("gone", "same"):
        tmp = tmp_path / ".new.tmp"
        tmp.write_bytes(b"new")
        (tmp_path / "same").write_bytes(b"new")
        final.unlink(missing_ok=True)
        os.symlink(tmp_path / target, final)
        with pytest.raises(ValueError, match=r"exists \(a symbolic link\), not this export's"):
            onnx_external._place(str(tmp), str(final), _digest(b"new"))
        assert os.readlink(final) == str(tmp_path / target)


@pytest.mark.parametrize("name", ["n.onnx.0123456789abcdef.data", "m.onnx.0123456789abcde.data"])
def test_overwrite_keeps_a_data_file_not_named_as_the_model_names_its_own(tmp_path, name):
    """The replaced export's data file is deleted only where its name is ``<model name>.<16
    hex digits>.data`` exactly: another model's name, or 15 digits, is kept."""
    t = _external_tensor([("location", name), ("offset", "0"), ("length", "16")])
    (tmp_path / name).write_bytes(bytes(16))
    (tmp_path / "m.onnx").write_bytes(_marked([t]).SerializeToString())
    write_model(onnx, _marked(), str(tmp_path / "m.onnx"), external=False, overwrite=True,
                inputs=())
    assert (tmp_path / name).read_bytes() == bytes(16)


class _Options:
    def __init__(self):
        self.entries = {}

    def add_session_config_entry(self, key, value):
        self.entries[key] = value


@pytest.mark.parametrize("given", ["path", "bytes"])
def test_the_session_entries_of_a_model_with_external_data(tmp_path, given):
    """The folder entry only where ORT gets the model's bytes (a path tells it the folder);
    an optimized model's tensors in ``<optimized name>.data`` (a name, beside it) from
    SIZE_THRESHOLD bytes."""
    options, folder = _Options(), str(tmp_path)
    model = str(tmp_path / "m.onnx") if given == "path" else b"model"
    session_entries(options, folder, model, tmp_path / "sub" / "opt.onnx")
    want = {"session.optimized_model_external_initializers_file_name": "opt.onnx.data",
            "session.optimized_model_external_initializers_min_size_in_bytes": "1024"}
    if given == "bytes":
        want["session.model_external_initializers_file_folder_path"] = folder
    assert options.entries == want
