"""Probe of the ONNX external data (s49/onnxext): what ORT writes for
``session(optimized_model_path=...)`` never replaces a file the session reads or one
quantscope did not write; an export through a symbolic link to another folder; the location
check walks every place a tensor can sit (functions and their defaults, sparse tensors,
attribute lists, training graphs), parses its entries strictly and names the rule broken; a
failed swap leaves no new data file; ``graph_bytes`` bounds the whole model; late refusals and
their messages."""

import os

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from tiny_models import twice_calibrated

from quantscope import export
from quantscope.exporters import onnx as qonnx

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def made():
    return twice_calibrated(0)


def _export(made, path, **kw):
    model, calib, x = made
    return export(calib, model, str(path), format="onnx", example_inputs=(x,), **kw)


def _run(path, x, **kw):
    sess = qonnx.session(str(path), threads=1, **kw)
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _data(folder):
    return next(n for n in os.listdir(folder) if n.endswith(".data"))


@pytest.mark.parametrize("external", [True, False], ids=["external", "one_file"])
def test_the_optimized_model_replaces_no_file_it_did_not_write(tmp_path, made, external):
    path = _export(made, tmp_path / "m.onnx", external_data=external)
    files = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    # a user's file at the optimized model's name, or (external) at its data file's
    for name in ("opt.onnx", *(("opt.onnx.data",) if external else ())):
        (tmp_path / "opt.onnx").unlink(missing_ok=True)
        (tmp_path / name).write_bytes(b"mine")
        with pytest.raises(ValueError, match=f"{name}' exists and is not an earlier"):
            qonnx.session(path, optimized_model_path=tmp_path / "opt.onnx")
        assert (tmp_path / name).read_bytes() == b"mine"
        (tmp_path / name).unlink()
    # the model itself, or its data file, through any path
    os.link(path, tmp_path / "hard.onnx")
    aliases = [path, tmp_path / "hard.onnx"]
    if external:
        aliases.append(str(tmp_path / _data(tmp_path))[:-len(".data")])
    for alias in aliases:
        with pytest.raises(ValueError, match="a file this session reads"):
            qonnx.session(path, optimized_model_path=alias)
    os.remove(tmp_path / "hard.onnx")
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == files
    # an earlier optimized model (and its data file) is replaced; it runs as the export
    x = made[2]
    for _ in range(2):
        got = _run(path, x, optimized_model_path=tmp_path / "opt.onnx")
    assert np.array_equal(got, _run(tmp_path / "opt.onnx", x))


def test_an_export_through_a_link_to_another_folder_is_refused(tmp_path, made):
    """ORT and onnx read the data relative to the folder of the path opened (the link's);
    the data file goes beside the link's target: a pair the returned path could not open."""
    (tmp_path / "real").mkdir()
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "real" / "m.onnx", tmp_path / "out" / "latest.onnx")
    with pytest.raises(ValueError, match="symbolic link to .*in another folder"):
        _export(made, tmp_path / "out" / "latest.onnx", external_data=True)
    assert os.listdir(tmp_path / "real") == [] and os.listdir(tmp_path / "out") == ["latest.onnx"]
    # a link in the model's own folder (or under a linked folder) opens: the pair is there
    os.symlink("m.onnx", tmp_path / "real" / "latest.onnx")
    os.symlink(tmp_path / "real", tmp_path / "linked")
    for link in (tmp_path / "real" / "latest.onnx", tmp_path / "linked" / "latest.onnx"):
        path = _export(made, link, external_data=True, overwrite=True)
        assert _run(path, made[2]).shape == (3, 32) and onnx.load(path) is not None
        assert os.path.islink(link)


def test_a_data_name_past_the_limit_is_refused_before_the_trace(tmp_path, made, monkeypatch):
    """Refused where ``<name>.<16 hex digits>.data`` would pass the file system's NAME_MAX;
    a data file's name of exactly NAME_MAX bytes is one it takes: that export goes on."""
    def trace(*a, **k):
        raise AssertionError("traced")

    monkeypatch.setattr(qonnx, "_export_float", trace)
    name = "m" * 240 + ".onnx"  # a legal name; its data file's would be 267 bytes
    with pytest.raises(ValueError, match="data file's name would be 267 bytes"):
        _export(made, tmp_path / name, external_data=True)
    with pytest.raises(AssertionError, match="traced"):  # one file: the name is legal
        _export(made, tmp_path / name)
    assert os.listdir(tmp_path) == []
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    name = "m" * (limit - 22 - len(".onnx")) + ".onnx"  # its data file's: limit bytes
    (tmp_path / f"{name}.{'0' * 16}.data").write_bytes(b"")  # which the file system takes
    with pytest.raises(AssertionError, match="traced"):
        _export(made, tmp_path / name, external_data=True)
    with pytest.raises(ValueError, match=f"data file's name would be {limit + 1} bytes"):
        _export(made, tmp_path / ("m" + name), external_data=True)


def _external_tensor(entries):
    from onnx import TensorProto, helper

    t = helper.make_tensor("w", TensorProto.FLOAT, [4], b"\0" * 16, raw=True)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in entries:
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _with_function(folder, entries):
    """A model calling a model-local function whose Constant holds an external tensor."""
    from onnx import TensorProto, helper

    const = helper.make_node("Constant", [], ["c"], value=_external_tensor(entries))
    fn = helper.make_function("local", "F", ["x"], ["y"],
                              [const, helper.make_node("Add", ["x", "c"], ["y"])],
                              [helper.make_opsetid("", 21)])
    graph = helper.make_graph(
        [helper.make_node("F", ["x"], ["y"], domain="local")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, functions=[fn], opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("local", 1)])
    path = folder / "crafted.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _in_graph(folder, entries):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [_external_tensor(entries)])
    path = folder / "crafted.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 21)]).SerializeToString())
    return path


@pytest.mark.parametrize("case", ["function_up", "function_absolute", "repeated_location",
                                  "repeated_offset_key", "underscore", "space", "sign",
                                  "arabic_indic", "ok", "function_ok"])
def test_the_location_check_walks_functions_and_parses_strictly(tmp_path, monkeypatch, case):
    from quantscope.exporters.onnx_locations import read_graph

    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.bin").write_bytes(secret.read_bytes())
    ok = [("location", "w.bin"), ("offset", "0"), ("length", "16")]
    entries = {"function_up": [("location", "../secret.bin")],
               "function_absolute": [("location", str(secret))],
               "repeated_location": [("location", "../secret.bin"), ("location", "w.bin")],
               "repeated_offset_key": [*ok, ("length", "16")],
               "underscore": [("location", "w.bin"), ("offset", "0_0")],
               "space": [("location", "w.bin"), ("offset", " 0")],
               "sign": [("location", "w.bin"), ("offset", "+0")],
               "arabic_indic": [("location", "w.bin"), ("length", "\u0661\u0666")],
               "ok": ok, "function_ok": ok}[case]
    path = (_with_function if case.startswith("function") else _in_graph)(folder, entries)
    if case.endswith("ok"):
        assert read_graph(path)[1] == str(folder)
        return
    with pytest.raises(ValueError, match=r"tensor 'w' has its data in .*, which "):
        read_graph(path)
    opened = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match="quantscope reads external data only"):
        qonnx.session(path)
    assert opened == []


def test_a_failed_swap_removes_the_data_file_it_made(tmp_path, made, monkeypatch):
    from quantscope.exporters import atomic

    path = _export(made, tmp_path / "m.onnx", external_data=True)
    old = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    real = os.replace

    def swap(src, dst):
        if os.fspath(dst) == str(path):
            raise OSError("swap failed")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", swap)
    with pytest.raises(OSError, match="swap failed"):  # another model: another data file
        _export(twice_calibrated(1), path, external_data=True, overwrite=True)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == old
    # an identical export reuses the data file: a failed swap keeps it
    with pytest.raises(OSError, match="swap failed"):
        _export(made, path, external_data=True, overwrite=True)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == old


def _holding(container, tensor):
    """A model whose one external tensor, ``tensor``, lies in ``container`` (every place a
    ModelProto holds a tensor: read_graph's walk, onnx_locations' module doc)."""
    from onnx import AttributeProto, TensorProto, helper

    holder = helper.make_graph([], "holder", [], [], [tensor])  # an initializer of a graph
    sparse = helper.make_sparse_tensor(
        tensor, helper.make_tensor("i", TensorProto.INT64, [4], range(4)), [8])
    node = helper.make_node("Identity", ["x"], ["y"])
    value = {"attribute_graph": holder, "attribute_graphs": [holder],
             "attribute_tensors": [tensor], "attribute_sparse_tensor": sparse,
             "attribute_sparse_tensors": [sparse]}.get(container)
    if value is not None:
        node.attribute.append(helper.make_attribute("held", value))
    functions = []
    if container == "function_default":  # a Constant whose value is the function's attribute
        const = helper.make_node("Constant", [], ["c"])
        const.attribute.add(name="value", ref_attr_name="v", type=AttributeProto.TENSOR)
        functions.append(helper.make_function(
            "local", "F", ["x"], ["y"], [const, helper.make_node("Add", ["x", "c"], ["y"])],
            [helper.make_opsetid("", 21)], attribute_protos=[helper.make_attribute("v", tensor)]))
        node = helper.make_node("F", ["x"], ["y"], domain="local")
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    if container == "sparse_initializer":
        graph.sparse_initializer.append(sparse)
    model = helper.make_model(graph, functions=functions, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("local", 1)])
    if container.startswith("training_"):  # a training graph's initialization / algorithm
        getattr(model.training_info.add(), container.split("_")[1]).CopyFrom(holder)
    return model


@pytest.mark.parametrize("container", [
    "sparse_initializer", "attribute_graph", "attribute_graphs", "attribute_tensors",
    "attribute_sparse_tensor", "attribute_sparse_tensors", "function_default",
    "training_initialization", "training_algorithm"])
def test_the_location_check_walks_every_tensor_container(tmp_path, container):
    """An external tensor anywhere in the model is checked: ``../secret.bin`` refused in
    each place, a file in the folder found there (the folder returned: the model has external
    data). ONNX Runtime 1.32 reads a function's default attribute's tensor (it inlines the
    function), which onnx's own external-data walk skips."""
    from quantscope.exporters.onnx_locations import read_graph

    (tmp_path / "secret.bin").write_bytes(bytes(16))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.bin").write_bytes(bytes(16))
    path = folder / "m.onnx"
    for location in ("../secret.bin", "w.bin"):
        tensor = _external_tensor([("location", location), ("offset", "0"), ("length", "16")])
        path.write_bytes(_holding(container, tensor).SerializeToString())
        if location == "w.bin":
            assert read_graph(path)[1] == str(folder)
            continue
        with pytest.raises(ValueError, match=r"tensor 'w' has its data in '\.\./secret\.bin', "
                                             r"which leads out of the model's folder \(\.\.\)"):
            read_graph(path)


def test_an_earlier_optimized_model_naming_another_file_too_keeps_its_data(tmp_path,
                                                                          monkeypatch):
    """``opt.data`` is replaced only where the quantscope model at ``opt`` names it as its one
    location: a model there that names another file too is not one ONNX Runtime wrote, and
    is refused; one naming ``opt.data`` alone is replaced."""
    from onnx import helper

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.bin").write_bytes(bytes(16))
    path = _in_graph(folder, [("location", "w.bin"), ("offset", "0"), ("length", "16")])
    opened = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: opened.append(a))
    opt = tmp_path / "opt.onnx"
    for name in ("opt.onnx.data", "other.data"):
        (tmp_path / name).write_bytes(bytes(16))
    for locations in (["opt.onnx.data", "other.data"], ["opt.onnx.data"]):
        earlier = helper.make_model(helper.make_graph([], "g", [], [], [
            _external_tensor([("location", n), ("offset", "0"), ("length", "16")])
            for n in locations]))
        earlier.metadata_props.add(key="quantscope", value="onnx export")  # the export's mark
        opt.write_bytes(earlier.SerializeToString())
        if len(locations) == 1:
            qonnx.session(path, optimized_model_path=opt)
            assert len(opened) == 1
            continue
        with pytest.raises(ValueError, match=r"opt\.onnx\.data' exists and is not an earlier "
                                             r"optimized model"):
            qonnx.session(path, optimized_model_path=opt)
        assert opened == []


@pytest.mark.parametrize("container", [
    "sparse_initializer", "attribute_sparse_tensor", "attribute_sparse_tensors"])
def test_a_sparse_tensors_external_indices_are_checked_too(tmp_path, container):
    """A sparse tensor is two tensors (onnx's SparseTensorProto: values and indices), and
    either may be external data: indices at ``../secret.bin`` beside inline values are
    refused in every sparse container (pins L04: the attribute walk yielding the values
    alone)."""
    from onnx import TensorProto, helper

    from quantscope.exporters.onnx_locations import read_graph

    (tmp_path / "secret.bin").write_bytes(bytes(32))
    folder = tmp_path / "model"
    folder.mkdir()
    indices = _external_tensor([("location", "../secret.bin"), ("offset", "0"),
                                ("length", "32")])
    indices.name, indices.data_type, indices.dims[:] = "i", TensorProto.INT64, [4]
    sparse = helper.make_sparse_tensor(
        helper.make_tensor("v", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0]), indices, [8])
    node = helper.make_node("Identity", ["x"], ["y"])
    if container != "sparse_initializer":
        value = sparse if container == "attribute_sparse_tensor" else [sparse]
        node.attribute.append(helper.make_attribute("held", value))
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    if container == "sparse_initializer":
        graph.sparse_initializer.append(sparse)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ValueError, match=r"tensor 'i' has its data in '\.\./secret\.bin', "
                                         r"which leads out of the model's folder \(\.\.\)"):
        read_graph(path)
