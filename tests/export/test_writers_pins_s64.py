"""Pins of the writers' behaviour that no test held (mutation round s64): each test fails on
one mutant of src/quantscope/exporters (the swap, its fallback and lock, the output guard's
marker and refusals, the ONNX data file's flush and placement, the location checks, vLLM's
scheme rules and the MoE expert names) that the existing tests let through. Expected values come
from the definitions: the module docs and docstrings, docs/SECURITY.md ("What it writes"),
renameat2(2) and flock(2), and vLLM's compressed-tensors scheme choice."""

import errno
import fcntl
import hashlib
import os

import pytest

from quantscope.exporters import atomic, atomic_swap


def test_a_target_moved_aside_meanwhile_is_created_on_the_next_try(tmp_path):
    """``swap_in``: a ``FileNotFoundError`` (another writer without the exchange moved the
    output aside between the look and the rename) is retried, not raised."""
    (tmp_path / "new").mkdir()
    calls = []

    def renameat2(src, dst, flags):
        calls.append(flags)
        if len(calls) == 1:
            raise FileNotFoundError(errno.ENOENT, "gone", dst)
        os.rename(src, dst)
        return True

    atomic_swap.swap_in(str(tmp_path / "new"), str(tmp_path / "out"), lambda: None, ".out.",
                        renameat2)
    assert calls == [atomic_swap._RENAME_NOREPLACE] * 2
    assert os.listdir(tmp_path) == ["out"]


def test_the_locked_swap_checks_the_existing_output_again_under_the_lock(tmp_path):
    """Without ``renameat2`` the swap re-checks the output found at the path once it holds
    the parent's lock (another writer's may have come since the first check): a refusal
    then moves nothing."""
    (tmp_path / "new").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "theirs.txt").write_text("T")
    checks = []

    def check():  # the first check passes; another writer's output is there by the second
        checks.append(1)
        if len(checks) > 1:
            raise ValueError("not yours")

    with pytest.raises(ValueError, match="not yours"):
        atomic_swap.swap_in(str(tmp_path / "new"), str(tmp_path / "out"), check, ".out.",
                            lambda *a: False)
    assert len(checks) == 2
    assert sorted(os.listdir(tmp_path)) == ["new", "out"]
    assert (tmp_path / "out" / "theirs.txt").read_text() == "T"


def test_removing_a_link_to_a_folder_removes_the_link_not_the_folder(tmp_path):
    """``_remove`` of a symbolic link to a folder deletes the link: never the files of the
    folder it points at, and no warning of a leftover."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep.txt").write_text("K")
    os.symlink(tmp_path / "target", tmp_path / "link")
    atomic_swap._remove(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link")
    assert (tmp_path / "target" / "keep.txt").read_text() == "K"


def test_the_parent_lock_excludes_every_other_lock(tmp_path):
    """The fallback swap's writers "take turns on a lock on the parent folder": the lock is
    exclusive (flock ``LOCK_EX``), so even a shared lock of another writer waits."""
    with atomic_swap._parent_lock(str(tmp_path)):
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def _one_weight_model(name="w", count=1024):
    """A model adding a float32 initializer of ``count`` elements (4 KiB: over the data
    file's 1 KiB threshold)."""
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(count, dtype=np.float32), name)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", name], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [count])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [count])], [w])
    return onnx, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _fd_path(fd):
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd by /proc")
def test_the_data_file_and_the_model_are_flushed_to_the_disk_before_each_is_named(
        tmp_path, monkeypatch):
    """docs/SECURITY.md: the data file "is written under a temporary name and flushed to the
    disk, renamed to its name ... and only then is the model swapped in": ``fsync`` of the
    data file before its rename, of the model's temporary before the swap."""
    from quantscope.exporters import onnx_external

    onnx, model = _one_weight_model()
    events, real_fsync, real_replace = [], os.fsync, os.replace
    real_rename2 = onnx_external._renameat2

    def fsync(fd):
        events.append(("fsync", os.path.basename(_fd_path(fd))))
        real_fsync(fd)

    def renameat2(src, dst, flags):
        events.append(("place", os.path.basename(src), os.path.basename(dst)))
        return real_rename2(src, dst, flags)

    def replace(src, dst):
        events.append(("swap", os.path.basename(src), os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(onnx_external, "_renameat2", renameat2)
    onnx_external.write_model(onnx, model, tmp_path / "m.onnx", external=True,
                              overwrite=False, inputs=())
    place = next(e for e in events if e[0] == "place")
    swap = next(e for e in events if e[0] == "swap" and e[2] == "m.onnx")
    assert place[2].startswith("m.onnx.") and place[2].endswith(".data")
    assert ("fsync", place[1]) in events[:events.index(place)]  # the data, before its name
    assert ("fsync", swap[1]) in events[events.index(place):events.index(swap)]  # the model
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", place[2]]


def _digest(data):
    return hashlib.sha256(data).hexdigest()


def test_the_locked_placement_never_replaces_a_data_file(tmp_path, monkeypatch):
    """Without ``renameat2`` (``RENAME_NOREPLACE``) the data file is placed under the
    parent's lock, still never over a file there: one of other bytes is refused, kept."""
    from quantscope.exporters import onnx_external

    monkeypatch.setattr(onnx_external, "_renameat2", lambda *a: False)
    tmp, final = tmp_path / ".new.tmp", tmp_path / "m.onnx.0123456789abcdef.data"
    tmp.write_bytes(b"new")
    final.write_bytes(b"theirs")
    with pytest.raises(ValueError, match=r"exists \(a file of other bytes\), not this "
                                         r"export's data file"):
        onnx_external._place(str(tmp), str(final), _digest(b"new"))
    assert final.read_bytes() == b"theirs"
    free = tmp_path / "m.onnx.fedcba9876543210.data"
    assert onnx_external._place(str(tmp), str(free), _digest(b"new")) == str(free)
    assert free.read_bytes() == b"new" and not tmp.exists()


@pytest.mark.parametrize(("offset", "ok"), [("4", True), ("16", True), ("17", False)])
def test_a_location_without_a_length_spans_the_rest_of_its_file(tmp_path, offset, ok):
    """No ``length`` entry: the tensor's data runs from ``offset`` to the file's end (the
    ONNX spec's external data), so any offset within the 16-byte file is read; one past its
    end is refused."""
    pytest.importorskip("onnx")
    from test_onnx_external_probe_s49 import _in_graph

    from quantscope.exporters.onnx_locations import read_graph

    (tmp_path / "w.bin").write_bytes(bytes(16))
    path = _in_graph(tmp_path, [("location", "w.bin"), ("offset", offset)])
    if ok:
        assert read_graph(path)[1] == str(tmp_path)
        return
    with pytest.raises(ValueError, match=r"which offset 17 and length None lie outside its "
                                         r"16 bytes"):
        read_graph(path)


def _weight(spec, scale, dynamic=False, zero=None, global_scale=None, rows=2):
    import torch

    from quantscope.calibration.results.role_state import RoleState
    from quantscope.qparams import QParams

    scale = torch.as_tensor(scale, dtype=torch.float32)
    zp = torch.zeros_like(scale, dtype=torch.int32) if zero is None else zero
    return RoleState(spec, "minmax", "minmax", dynamic=dynamic, shape=(rows, 16),
                     qparams=QParams(scale, zp, global_scale))


_FOUND = {"m.experts": (1, ("w1", "w3", "w2"), True)}


def _fp8():
    from quantscope.layout import Tensor
    from quantscope.spec import QuantSpec

    return QuantSpec("fp8_e4m3", Tensor())


def test_fp8_gate_and_up_scales_are_read_as_the_larger_one_warned_once_for_all():
    """``fuse_expert_states``: differing float8 per-tensor weight scales of w1 / w3 join as
    the larger (vLLM re-quantizes both to it); one warning names the first pair and counts
    the other experts."""
    import torch

    found = {"m.experts": (3, ("w1", "w3", "w2"), True)}
    states = {f"m.experts.{e}.{n}": {"weight": _weight(_fp8(), s)}
              for e in range(3) for n, s in (("w1", 0.5), ("w3", 2.0))}
    from quantscope.exporters.experts import fuse_expert_states

    with pytest.warns(UserWarning, match=r"experts m\.experts\.0: gate and up hold different "
                                         r"float8 per-tensor weight scales \(0\.5, 2\.0\) "
                                         r"\(and 2 more experts\); read with the larger"):
        out = fuse_expert_states(found, states, "read")
    for e in range(3):
        st = out[f"m.experts.{e}.gate_up_proj"]["weight"]
        assert torch.equal(st.qparams.scale, torch.tensor(2.0)) and st.shape == (4, 16)


def test_gate_and_up_of_two_modes_are_refused():
    """Gate and up joined into one ``gate_up_proj`` must share the spec *and* the mode
    (``dynamic``): the fused layer runs one quantizer."""
    from quantscope.exporters.experts import fuse_expert_states

    states = {"m.experts.0.w1": {"weight": _weight(_fp8(), 1.0)},
              "m.experts.0.w3": {"weight": _weight(_fp8(), 1.0, dynamic="local")}}
    with pytest.raises(ValueError, match="gate and up weights are quantized differently"):
        fuse_expert_states(_FOUND, states, "read")


def test_an_up_with_a_role_the_gate_lacks_is_refused():
    """``_join_roles``: gate and up must hold the same roles; an input quantizer on up alone
    is refused, not dropped."""
    from quantscope.exporters.experts import fuse_expert_states

    states = {"m.experts.0.w1": {"weight": _weight(_fp8(), 1.0)},
              "m.experts.0.w3": {"weight": _weight(_fp8(), 1.0),
                                 "input": _weight(_fp8(), 1.0)}}
    with pytest.raises(ValueError, match=r"gate has roles \['weight'\] but up \['input', "
                                         r"'weight'\]"):
        fuse_expert_states(_FOUND, states, "read")


def test_an_ungated_experts_up_layer_is_read_as_its_gate_up_proj():
    """Experts without a gate (``up_proj`` alone): the state read under the up name becomes
    the calibration's ``gate_up_proj``, the down's its ``down_proj``."""
    from quantscope.exporters.experts import fuse_expert_states

    up, down = {"weight": _weight(_fp8(), 1.0)}, {"weight": _weight(_fp8(), 2.0)}
    found = {"m.experts": (1, ("gate_proj", "up_proj", "down_proj"), False)}
    out = fuse_expert_states(found, {"m.experts.0.up_proj": up, "m.experts.0.down_proj": down})
    assert out == {"m.experts.0.gate_up_proj": up, "m.experts.0.down_proj": down}


def test_expert_layer_names_and_what_is_no_expert():
    """``EXPERT``: ``<... experts>.<e or expert_e>.<layer>``, the layer one name part: a
    ModuleDict item ``expert_3`` is an expert; a layer of no experts module, or a tensor
    below an expert's layer, is none."""
    from quantscope.exporters.moe_slots import expert_index, expert_slot

    assert expert_slot("model.layers.0.mlp.experts.expert_3.wi") == (
        "model.layers.0.mlp.experts", "wi")
    assert expert_slot("model.layers.0.block_sparse_moe.experts.7.w3") == (
        "model.layers.0.block_sparse_moe.experts", "w13")
    assert expert_slot("model.layers.0.mlp") is None
    assert expert_slot("model.layers.0.mlp.experts.0.w1.weight") is None
    assert [expert_index(k) for k in ("3", "expert_3", "3x", "token_dropout")] == [
        3, 3, None, None]


_INT4_GROUP = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 128}
_INT8 = {"num_bits": 8, "type": "int", "symmetric": True}
_TOKEN8 = dict(_INT8, strategy="token", dynamic=True)


@pytest.mark.parametrize(("weights", "inputs", "fmt", "served"), [
    (_INT4_GROUP, None, "marlin-24", True),  # WNA16's 2:4 sparse format
    (dict(_INT8, strategy="tensor"), dict(_INT8, strategy="tensor"), "int-quantized", True),
    (dict(_INT8, strategy="channel"), dict(_INT8, strategy="token"), "int-quantized", False),
    (dict(_INT4_GROUP, strategy="channel", group_size=None), _TOKEN8, "int-quantized", True),
], ids=["wna16_marlin24", "w8a8_static_tensor", "w8a8_static_token", "w4a8_channel"])
def test_which_int_schemes_vllm_serves(weights, inputs, fmt, served):
    """``vllm_refusal`` of int groups, as vLLM's ``_is_wNa16_group_channel`` (formats
    pack-quantized and marlin-24), ``_is_static_tensor_w8a8`` (tensor or channel weights with
    a static per-tensor input; a per-token input only dynamic) and ``_is_dynamic_token_w4a8_int``
    (int4 channel or group weights, dynamic per-token int8 input, any format)."""
    from quantscope.exporters.serving import vllm_refusal

    assert (vllm_refusal(weights, inputs, fmt) is None) == served


@pytest.mark.parametrize(("fmt", "dynamic", "served"), [
    ("int-quantized", False, True), ("pack-quantized", False, True),
    ("int-quantized", True, False)])
def test_int_weights_with_static_int8_input_and_output_are_wna8o8(fmt, dynamic, served):
    """``_is_wNa8o8_int``: channel or group int weights (pack- or int-quantized) with a
    static per-tensor int8 input and output; a dynamic input is no such scheme."""
    from quantscope.exporters.serving import vllm_refusal

    static = dict(_INT8, strategy="tensor", dynamic=False)
    inputs = dict(static, dynamic=dynamic)
    weights = dict(_INT4_GROUP, num_bits=2)  # none of W8A8, W4A8, WNA8 (not dynamic)
    assert (vllm_refusal(weights, inputs, fmt, static) is None) == served


@pytest.mark.parametrize(("weights", "inputs", "fmt", "served"), [
    ({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}, None,
     "mxfp4-pack-quantized", False),
    (dict(_INT4_GROUP, dynamic=True), None, "pack-quantized", False),
], ids=["fp4_groups_of_16", "dynamic_int4"])
def test_which_weight_only_experts_vllms_fused_moe_serves(weights, inputs, fmt, served):
    """``vllm_moe_refusal``: fp4 experts in groups are mxfp4 only in groups of 32 (``_is_mxfp4``),
    and WNA16 experts take static weights only (``_is_wNa16_group_channel``)."""
    from quantscope.exporters.serving import vllm_moe_refusal

    assert (vllm_moe_refusal(weights, inputs, fmt) is None) == served


def test_targets_resolve_exact_names_first_and_the_last_group_naming_one():
    """``resolver``: an exact name wins over a ``re:`` pattern and a class name; a target
    two groups name is the later group's (vLLM's ``target_scheme_map``)."""
    from quantscope.exporters.serving import resolver

    of = resolver([("re:.*proj", "pattern"), ("l.q_proj", "exact"), ("Linear", "class")])
    assert of("l.q_proj") == {"exact"} and of("l.k_proj") == {"pattern"}
    assert of("l.gate") == {"class"}
    assert resolver([("Linear", "first"), ("Linear", "second")])("l.x") == {"second"}


def test_a_packed_weight_alone_marks_a_layer_quantized():
    from quantscope.exporters.serving import quantized

    assert quantized({"l.weight_packed"}, "l") and not quantized({"l.weight"}, "l")


def test_how_problems_name_their_layers_and_groups():
    """The first layer and how many more; a group's targets counted, plural but for one."""
    from quantscope.exporters.serving import _first, describe

    assert _first(["a", "b", "c"]) == "'a' and 2 more" and _first(["a"]) == "'a'"
    assert describe("g", []) == "config group 'g' (0 targets)"
    assert describe("g", ["Linear"]) == "config group 'g' (1 target, first 'Linear')"


def test_a_groups_format_defaults_to_the_configs():
    """A config group without its own ``format`` takes the config's: weight-only int4 groups
    in an int-quantized checkpoint are no WNA16 (pack-quantized) scheme."""
    from quantscope.exporters.serving import unservable

    qc = {"format": "int-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": dict(_INT4_GROUP)}}}
    found = unservable(qc)
    assert [(n, t) for n, t, _ in found] == [("g", ["Linear"])]
    assert "format pack-quantized (got 4 bits, group, int-quantized)" in found[0][2]
    qc["config_groups"]["g"]["format"] = "pack-quantized"
    assert unservable(qc) == []


@pytest.mark.parametrize(("extra", "named"), [
    (3, r"\((u\d, ){2}u\d\): replacing"), (4, r"\((u\d, ){2}u\d and 1 more\): replacing")])
def test_the_refusal_names_three_unlisted_files_and_counts_the_rest(tmp_path, extra, named):
    """A folder holding files its marker does not list is refused naming three of them
    (walk order), and how many more, never "and 0 more"."""
    out = tmp_path / "run"
    with atomic.atomic_dir(out) as tmp, open(f"{tmp}/report.md", "w") as f:
        f.write("r")
    for i in range(extra):
        (out / f"u{i}").write_text("mine")
    with pytest.raises(ValueError, match=rf"holds what quantscope did not write there {named}"):
        atomic.check_writable_target(out, overwrite=True)


def test_the_kind_told_from_the_written_files_is_recorded_in_the_marker(tmp_path):
    """``atomic_dir(what=None)``: the kind written is "told from the files" and recorded in
    the marker (a calibration's ``quantscope.json``: ``calibration``)."""
    import json

    with atomic.atomic_dir(tmp_path / "c") as tmp, open(f"{tmp}/quantscope.json", "w") as f:
        json.dump({"format": "quantscope-calibration"}, f)
    marker = json.loads((tmp_path / "c" / atomic.MARKER).read_text())
    assert marker["kind"] == "calibration" and marker["files"] == ["quantscope.json"]


def test_a_markerless_folder_inside_an_output_is_the_users_not_a_nested_output(tmp_path):
    """A whole output nested in a folder is one with its own marker ("an output saved into
    the folder later carries its own marker"): a folder inside holding only an older
    calibration's ``quantscope.json`` is named as a file quantscope did not write there."""
    import json

    out = tmp_path / "run"
    with atomic.atomic_dir(out) as tmp, open(f"{tmp}/report.md", "w") as f:
        f.write("r")
    (out / "old").mkdir()
    (out / "old" / "quantscope.json").write_text(json.dumps(
        {"format": "quantscope-calibration"}))
    with pytest.raises(ValueError, match=r"holds what quantscope did not write there \(old/\)"):
        atomic.check_writable_target(out, overwrite=True)
