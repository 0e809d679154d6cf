"""ONNX export with external data (s49): a graph over protobuf's 2 GiB (``PROTOBUF_LIMIT``
lowered here, so a tiny model takes the path) is written as the model plus one data file,
``<name>.<16 hex digits>.data``, instead of being refused; ONNX Runtime's outputs are the
single-file export's; the pair is written and replaced by the rules of every output (nothing
foreign replaced, a failed write leaves the previous pair whole); and quantscope's readers
refuse a model whose tensors name data outside its folder."""

import hashlib
import os
import re

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from tiny_models import LinearTwice, twice_calibrated

from quantscope import calibrate, export
from quantscope.exporters import onnx as qonnx
from quantscope.exporters.onnx_tensors import unshared_codes

torch.set_num_threads(1)
DATA = re.compile(r"m\.onnx\.[0-9a-f]{16}\.data")


@pytest.fixture(scope="module")
def made():
    return {seed: twice_calibrated(seed) for seed in (0, 1)}


def _export(made, path, seed=0, **kw):
    model, calib, x = made[seed]
    return export(calib, model, path, format="onnx", example_inputs=(x,), **kw)


def _run(path, x):
    sess = qonnx.session(path, threads=1)
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _locations(path):
    proto = onnx.load(str(path), load_external_data=False)
    return [{e.key: e.value for e in t.external_data} for t in proto.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL]


@pytest.mark.parametrize("precise", [False, True], ids=["this_cpu", "u8u8"])
def test_a_graph_over_the_limit_is_written_with_external_data(tmp_path, made, monkeypatch,
                                                              precise):
    _export(made, tmp_path / "one" / "m.onnx")
    monkeypatch.setattr(qonnx, "PROTOBUF_LIMIT", 1000)
    _export(made, tmp_path / "two" / "m.onnx")  # external_data=None: over the limit
    names = sorted(os.listdir(tmp_path / "two"))
    assert len(names) == 2 and names[0] == "m.onnx" and DATA.fullmatch(names[1]), names
    data = (tmp_path / "two" / names[1]).read_bytes()
    assert names[1] == f"m.onnx.{hashlib.sha256(data).hexdigest()[:16]}.data"
    # the codes (64 x 64 and 32 x 64 int8) are in the data file; scales and biases are not
    assert sorted(int(e["length"]) for e in _locations(tmp_path / "two" / "m.onnx")) == \
        [32 * 64, 64 * 64]
    assert {e["location"] for e in _locations(tmp_path / "two" / "m.onnx")} == {names[1]}
    assert str(tmp_path).encode() not in (tmp_path / "two" / "m.onnx").read_bytes()
    if precise:  # the session loads a copy of the graph whose copies name the same bytes
        monkeypatch.setattr(qonnx, "int8_dot_product", lambda *a: False)
    x = made[0][2]
    np.testing.assert_array_equal(_run(tmp_path / "two" / "m.onnx", x),
                                  _run(tmp_path / "one" / "m.onnx", x))


def test_the_external_data_option(tmp_path, made, monkeypatch):
    before = (_export(made, tmp_path / "a.onnx"), sorted(os.listdir(tmp_path)))
    assert before[1] == ["a.onnx"]  # a small model: one file, as before
    _export(made, tmp_path / "b" / "m.onnx", external_data=True)
    assert len(os.listdir(tmp_path / "b")) == 2
    with pytest.raises(ValueError, match="external_data must be"):
        _export(made, tmp_path / "c.onnx", external_data="yes")
    monkeypatch.setattr(qonnx, "PROTOBUF_LIMIT", 1000)
    with pytest.raises(ValueError, match=r"over protobuf's 2 GiB limit .* external_data=False"):
        _export(made, tmp_path / "d.onnx", external_data=False)
    assert sorted(os.listdir(tmp_path)) == ["a.onnx", "b"]


def test_overwrite_replaces_the_pair_and_deletes_the_old_data(tmp_path, made):
    path = tmp_path / "m.onnx"
    _export(made, path, external_data=True)
    old = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    with pytest.raises(ValueError, match="exists; pass overwrite=True"):
        _export(made, path, seed=1, external_data=True)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == old
    # the same export again: the same data file, kept as it is (same inode)
    data = next(n for n in old if DATA.fullmatch(n))
    inode = os.stat(tmp_path / data).st_ino
    _export(made, path, external_data=True, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == sorted(old) and \
        os.stat(tmp_path / data).st_ino == inode
    # another model: a new data file, the old one deleted once the model is swapped in
    _export(made, path, seed=1, external_data=True, overwrite=True)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and data not in names
    x = made[1][2]
    with torch.no_grad(), made[1][1].apply(made[1][0]):
        ref = made[1][0](x).numpy()
    assert np.abs(_run(path, x) - ref).max() <= 1e-5 * np.abs(ref).max()
    # a single-file export over it: its data file goes too
    _export(made, path, overwrite=True)
    assert os.listdir(tmp_path) == ["m.onnx"]


def test_a_file_at_the_data_files_name_is_never_replaced(tmp_path, made):
    _export(made, tmp_path / "probe" / "m.onnx", external_data=True)
    name = next(n for n in os.listdir(tmp_path / "probe") if DATA.fullmatch(n))
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_bytes(b"someone else's weights")
    with pytest.raises(ValueError, match=r"exists \(a file of other bytes\), not this export's "
                                         r"data file"):
        _export(made, out / "m.onnx", external_data=True)
    assert os.listdir(out) == [name] and (out / name).read_bytes() == b"someone else's weights"


@pytest.mark.parametrize("kind", ["a folder", "a FIFO", "a symbolic link"])
def test_the_refusal_names_what_is_at_the_data_files_name(tmp_path, made, kind):
    _export(made, tmp_path / "probe" / "m.onnx", external_data=True)
    name = next(n for n in os.listdir(tmp_path / "probe") if DATA.fullmatch(n))
    out = tmp_path / "out"
    out.mkdir()
    make = {"a folder": os.mkdir, "a FIFO": os.mkfifo,
            "a symbolic link": lambda p: os.symlink(tmp_path / "probe" / name, p)}[kind]
    make(out / name)  # (the link: to this export's own bytes, still never replaced)
    with pytest.raises(ValueError, match=rf"exists \({kind}\), not this export's data file"):
        _export(made, out / "m.onnx", external_data=True)
    assert os.listdir(out) == [name]


def test_a_failed_write_leaves_the_previous_pair_whole(tmp_path, made, monkeypatch):
    path = tmp_path / "m.onnx"
    _export(made, path, external_data=True)
    old = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}

    def crash(model, *a, **k):  # after the new data file is in place, before the swap
        assert len(os.listdir(tmp_path)) == 4  # old pair, new data, the model's temporary
        raise RuntimeError("killed")

    monkeypatch.setattr(onnx.checker, "check_model", crash)
    with pytest.raises(RuntimeError, match="killed"):
        _export(made, path, seed=1, external_data=True, overwrite=True)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == old


def test_overwrite_deletes_only_a_data_file_named_as_the_export_names_it(tmp_path, made):
    """A quantscope model whose tensors name another file (crafted, or a renamed pair):
    replacing it deletes nothing but the model."""
    out = tmp_path / "out"
    _export(made, out / "m.onnx", external_data=True)
    data = next(n for n in os.listdir(out) if DATA.fullmatch(n))
    (tmp_path / data).write_bytes((out / data).read_bytes())  # outside the folder
    (out / "keep.data").write_bytes((out / data).read_bytes())
    for location in (f"../{data}", "keep.data"):
        proto = onnx.load(str(out / "m.onnx"), load_external_data=False)
        for t in proto.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = location
        (out / "m.onnx").write_bytes(proto.SerializeToString())
        _export(made, out / "m.onnx", seed=1, overwrite=True)
        assert (tmp_path / data).exists() and (out / "keep.data").exists()


def _marked(tensors=()):
    """A model carrying the export's metadata entry (what ``overwrite`` may replace), its
    initializers ``tensors``."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], list(tensors))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.metadata_props.add(key="quantscope", value="onnx export")
    return model


OWN, OTHER = "m.onnx.0123456789abcdef.data", "m.onnx.fedcba9876543210.data"


@pytest.mark.parametrize("case", ["own", "suffixed", "two_own", "link"])
def test_overwrite_deletes_the_old_data_only_where_it_names_one_plain_file_of_its_own(
        tmp_path, case):
    """The replaced export's data file is deleted where its model names one location,
    ``<model name>.<16 hex digits>.data`` exactly, a plain file beside it; a kept copy named
    ``<that>.orig``, two files each named so (quantscope never writes that), or a symbolic
    link at that name (and its target) are left."""
    from onnx import TensorProto, helper

    from quantscope.exporters.onnx_external import write_model

    out = tmp_path / "out"
    out.mkdir()
    locations = {"own": [OWN], "suffixed": [OWN + ".orig"], "two_own": [OWN, OTHER],
                 "link": [OWN]}[case]
    tensors = []
    for i, name in enumerate(locations):
        (out / name).write_bytes(bytes(16))
        t = helper.make_tensor(f"w{i}", TensorProto.FLOAT, [4], [0.0] * 4)
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=name)
        tensors.append(t)
    if case == "link":  # the data moved elsewhere, a link left at its name
        (out / OWN).rename(tmp_path / OWN)
        os.symlink(tmp_path / OWN, out / OWN)
    (out / "m.onnx").write_bytes(_marked(tensors).SerializeToString())
    before = sorted(os.listdir(out))
    write_model(onnx, _marked(), str(out / "m.onnx"), external=False, overwrite=True, inputs=())
    assert sorted(os.listdir(out)) == (["m.onnx"] if case == "own" else before)
    if case == "link":  # the link in the listing; its target too
        assert (tmp_path / OWN).read_bytes() == bytes(16)


def test_the_data_file_takes_tensors_from_1_kib_and_aligns_those_from_1_mib(tmp_path):
    """SIZE_THRESHOLD bytes or more go to the data file, fewer stay in the model; tensors of
    1 MiB or more start at a multiple of ALIGNMENT, smaller ones where the last ended."""
    from onnx import numpy_helper

    from quantscope.exporters.onnx_external import ALIGNMENT, SIZE_THRESHOLD, write_model

    sizes = {"below": SIZE_THRESHOLD - 1, "at": SIZE_THRESHOLD, "under_mib": (1 << 20) - 1,
             "mib": 1 << 20}
    arrays = {n: (np.arange(k) % 251).astype(np.uint8) for n, k in sizes.items()}
    tensors = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    path = tmp_path / "m.onnx"
    write_model(onnx, _marked(tensors), str(path), external=True, overwrite=False, inputs=())
    proto = onnx.load(str(path), load_external_data=False)
    offsets = {t.name: {e.key: e.value for e in t.external_data}.get("offset")
               for t in proto.graph.initializer}
    # 1024 + (1 MiB - 1) = 1049599 bytes written before the 1 MiB tensor: padded to 17 x 64 KiB
    assert offsets == {"below": None, "at": "0", "under_mib": "1024",
                       "mib": str(17 * ALIGNMENT)}
    loaded = onnx.load(str(path))
    for t in loaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), arrays[t.name])


def _crafted(folder, location, offset=0, length=16):
    """A model adding a 4-float initializer whose data lies at ``location`` (``length``
    None: no length entry, the rest of the file)."""
    from onnx import TensorProto, helper

    t = helper.make_tensor("w", TensorProto.FLOAT, [4], b"\0" * 16, raw=True)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", offset), ("length", length)):
        if v is not None:
            e = t.external_data.add()
            e.key, e.value = k, str(v)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [t])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    path = folder / "crafted.onnx"
    path.write_bytes(model.SerializeToString())
    return path


NOT_RELATIVE, UP = "is not a relative path", r"leads out of the model's folder \(\.\.\)"
#: case: (location, why it is refused; None: it loads). The Windows spellings name files
#: made in the folder (legal POSIX names), so only their own test can refuse them
LOCATIONS = {
    "up": ("../secret.bin", UP), "backslash_up": ("..\\secret.bin", UP),
    "absolute": (None, NOT_RELATIVE), "backslash_absolute": ("\\w.bin", NOT_RELATIVE),
    "drive": ("C:w.bin", NOT_RELATIVE),
    "link_out": ("link.bin", "is a symbolic link"), "link_in": ("in.bin", "is a symbolic link"),
    "linked_folder_out": ("out/secret.bin",
                          r"lies outside the model's folder \(through a symbolic link\)"),
    "fifo": ("fifo", "is not a regular file"), "fifo_no_length": ("fifo", "is not a regular file"),
    "past_end": ("w.bin", "offset 8 and length 16 lie outside its 16 bytes"),
    # ONNX Runtime's tag for initializers it holds in memory (offset: an address)
    "ort_memory": ("*/_ORT_MEM_ADDR_/*", r"cannot be read \(.+\)"),
    "ok": ("w.bin", None), "linked_folder_in": ("in/w.bin", None)}


def _locations_folder(tmp_path):
    """``model/`` beside ``secret.bin``: ``w.bin``, the Windows spellings' files, links to a
    file and a folder outside and inside, a FIFO."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("w.bin", "..\\secret.bin", "\\w.bin", "C:w.bin"):
        (folder / name).write_bytes(secret.read_bytes())
    os.symlink(secret, folder / "link.bin")
    os.symlink(folder / "w.bin", folder / "in.bin")
    os.symlink(tmp_path, folder / "out")
    os.symlink(".", folder / "in")
    os.mkfifo(folder / "fifo")
    return folder


@pytest.mark.parametrize("case", list(LOCATIONS))
@pytest.mark.parametrize("precise", [False, True], ids=["this_cpu", "u8u8"])
def test_a_location_outside_the_models_folder_is_refused_before_ort_reads(
        tmp_path, monkeypatch, case, precise):
    """Each refusal names its own reason (onnx_locations' module doc); a link to a folder
    inside, under which the file is no link, loads."""
    location, why = LOCATIONS[case]
    folder = _locations_folder(tmp_path)
    path = _crafted(folder, location or str(tmp_path / "secret.bin"),
                    offset=8 if case == "past_end" else 0,
                    length=None if case == "fifo_no_length" else 16)
    if precise:
        monkeypatch.setattr(qonnx, "int8_dot_product", lambda *a: False)
    if why is None:
        got = qonnx.session(path).run(None, {"x": np.ones(4, np.float32)})[0]
        np.testing.assert_array_equal(got, np.arange(4) + 1)
        return
    opened = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match=rf"tensor 'w' has its data in .*, which {why}; "
                                         r"quantscope reads external data only from a file "
                                         r"inside the model's folder"):
        qonnx.session(path)
    assert opened == []


def test_the_graph_checks_run_on_a_graph_read_without_its_data(tmp_path, made, monkeypatch):
    """unshared_codes and the float32 check take a graph whose tensors are external (read
    with load_external_data=False): the copies name the same bytes, nothing is read."""
    from quantscope.exporters.onnx_tensors import check_float32_quantize

    monkeypatch.setattr(qonnx, "PROTOBUF_LIMIT", 1000)
    path = _export(made, tmp_path / "m.onnx")
    proto = onnx.load(str(path), load_external_data=False)
    check_float32_quantize(proto)
    copied = onnx.load_from_string(unshared_codes(path, proto))
    external = [t for t in copied.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) == 3  # a's codes, their copy for the second call, b's codes
    by_bytes = {}
    for t in external:
        e = {x.key: x.value for x in t.external_data}
        by_bytes.setdefault((e["offset"], e["length"]), []).append(t.name)
    assert sorted(map(len, by_bytes.values())) == [1, 2]


def test_an_optimized_model_keeps_its_tensors_in_a_data_file(tmp_path, made, monkeypatch):
    monkeypatch.setattr(qonnx, "PROTOBUF_LIMIT", 1000)
    path = _export(made, tmp_path / "m.onnx")
    qonnx.session(path, optimized_model_path=tmp_path / "opt.onnx")
    assert (tmp_path / "opt.onnx.data").exists()
    counts = qonnx.integer_kernel_counts(tmp_path / "opt.onnx")
    assert counts.get("MatMulIntegerToFloat", 0) == 3, counts


def test_the_rewrite_refuses_a_weight_held_as_external_data(tmp_path, made, monkeypatch):
    """torch.onnx's proto holds every tensor's bytes; one that did not would have been read
    by onnx relative to the working folder: refused, naming the layer."""
    real = qonnx._export_float

    def external(*a, **k):
        proto = real(*a, **k)
        for t in proto.graph.initializer:
            if t.name.startswith("a.") and t.name.endswith("weight"):
                t.ClearField("raw_data")
                t.data_location = onnx.TensorProto.EXTERNAL
                e = t.external_data.add()
                e.key, e.value = "location", "w.bin"
        return proto

    monkeypatch.setattr(qonnx, "_export_float", external)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.bin").write_bytes(bytes(64 * 64 * 4))
    with pytest.raises(ValueError, match=r"onnx export: a: the graph holds its weight "
                                         r"'a\.weight' as external data"):
        _export(made, tmp_path / "out" / "m.onnx")


def test_a_model_that_names_no_location_is_not_parsed_for_the_check(tmp_path, made):
    from quantscope.exporters.onnx_locations import read_graph

    path = _export(made, tmp_path / "m.onnx")
    assert read_graph(path) == (None, None)
    # "location" in a tensor's bytes: parsed, and no external data found
    proto = onnx.load(str(path))
    proto.graph.initializer[0].raw_data = b"location" + proto.graph.initializer[0].raw_data[8:]
    (tmp_path / "n.onnx").write_bytes(proto.SerializeToString())
    graph, folder = read_graph(tmp_path / "n.onnx")
    assert graph is not None and folder is None


def test_dropping_the_replaced_weights_copies_no_kept_tensor():
    """drop_unused_initializers deleted every initializer and extended the graph with the
    kept ones, which protobuf (upb) copies: a 2.2 GB model's float tensors held twice."""
    from onnx import TensorProto, helper

    from quantscope.exporters.onnx_graph import drop_unused_initializers

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "kept"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [helper.make_tensor(n, TensorProto.FLOAT, [1], [1.0]) for n in ("unused", "kept")])
    kept = graph.initializer[1]
    drop_unused_initializers(graph)
    kept.dims[0] = 7  # the graph's own tensor, not a copy of it
    assert [(t.name, list(t.dims)) for t in graph.initializer] == [("kept", [7])]


@pytest.mark.parametrize("preset", ["w8a8", "int4"])
def test_the_graphs_size_is_bounded_without_serializing_its_tensors(tmp_path, preset):
    """graph_bytes (the external-data decision) counts raw tensors from their dims and type
    (upb's ByteSize() serializes each one): never below what protobuf writes of the whole
    model (value_info, metadata and opsets too), and close."""
    from quantscope.exporters.onnx_external import graph_bytes

    torch.manual_seed(0)
    model, x = LinearTwice().eval(), torch.randn(3, 64)
    if preset == "int4":  # weight-only int4 per channel: codes packed two per byte
        from quantscope import Channel, QuantSpec
        from quantscope.calibration.recipe import Recipe, Role, Rule

        preset = Recipe(Rule(("Linear",), weight=Role(QuantSpec("int4", Channel(0)), "minmax")))
    calib = calibrate(model, [x], preset, progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=(x,))
    proto = onnx.load(str(path))
    exact = len(proto.SerializeToString())  # value_info, metadata, opsets included
    assert exact <= graph_bytes(proto) <= exact * 1.1


def _branching(external):
    """A model whose If branches (one graph, held twice) hold a SIZE_THRESHOLD-byte
    initializer, ``external``: its data already named elsewhere."""
    from onnx import TensorProto, helper, numpy_helper

    from quantscope.exporters.onnx_external import SIZE_THRESHOLD

    big = numpy_helper.from_array(np.arange(SIZE_THRESHOLD, dtype=np.uint8), "branch_w")
    if external:
        big.ClearField("raw_data")
        big.data_location = TensorProto.EXTERNAL
        big.external_data.add(key="location", value="old.bin")
    out = [helper.make_tensor_value_info("o", TensorProto.UINT8, None)]
    branch = helper.make_graph([helper.make_node("Identity", ["branch_w"], ["o"])], "then",
                               [], out, [big])
    node = helper.make_node("If", ["c"], ["o"], then_branch=branch, else_branch=branch)
    return helper.make_model(helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, [])], out))


def test_the_data_file_takes_the_initializers_of_subgraphs(tmp_path):
    """The data file holds every initializer of SIZE_THRESHOLD bytes or more of the graph
    "and of its subgraphs (an If's, a Loop's branches)" (onnx_locations._initializers), and
    one already external there is refused (pins L06: _node_graphs yielding no graph)."""
    from quantscope.exporters.onnx_external import SIZE_THRESHOLD, _write_data

    proto = _branching(external=False)
    with open(tmp_path / "d", "wb") as f:
        _, written = _write_data(proto, f)
    assert [(t.name, offset, length) for t, offset, length in written] == [
        ("branch_w", 0, SIZE_THRESHOLD), ("branch_w", SIZE_THRESHOLD, SIZE_THRESHOLD)]
    for attribute in proto.graph.node[0].attribute:
        (w,) = attribute.g.initializer
        assert w.data_location == onnx.TensorProto.EXTERNAL and not w.HasField("raw_data")
    with open(tmp_path / "e", "wb") as f, pytest.raises(
            ValueError, match="initializer 'branch_w' is already external data"):
        _write_data(_branching(external=True), f)
