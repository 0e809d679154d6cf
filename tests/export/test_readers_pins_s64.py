"""Pins of what the checkpoint readers and ``check`` do that no test held, from a mutation
round (s64) over exporters/read.py, read_checks.py, read_refusals.py, value_checks.py,
consistency.py and source_folder.py: the reader refuses a quantized layer without its weight
scale, a config of no groups and a scale no read layer owns, reads a mixed-precision config,
takes a recorded source folder only where it exists and never for a smoothed checkpoint
(warning so); headers refuse negative or non-integer dims and read empty tensors; a zero
point at either end of its range is one; exact names with glob characters are escaped;
``check`` leaves a group's own packed zero points to the reader, compares no weight scale of
shards per tensor and per channel, reports NaN scales as non-finite only and prints values
float32 tells apart; ``model_path`` 0 is refused and ``copy_extras`` replaces nothing."""

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_check import ATTN, MLP, _fp8_group, nvfp4_checkpoint, write
from test_check_experts_held import EXPERTS, _fp8_experts, _write
from test_check_zero_points_s62 import _exported, _zero_points
from test_read_s39 import _edited
from test_read_validation import tiny_llama

from quantscope import Group, QuantSpec, Tensor
from quantscope.calibration import Calibration, calibrate
from quantscope.exporters import check
from quantscope.exporters.consistency import format_problems
from quantscope.exporters.read_checks import (
    exact_pattern,
    safetensors_headers,
    zero_point_problem,
)
from quantscope.exporters.source_folder import check_model_path, copy_extras


@pytest.mark.parametrize("value", [0, False])
def test_a_falsy_model_path_that_is_no_path_is_refused(value):
    """0 would be read as a file descriptor: only None means "no model_path"."""
    with pytest.raises(TypeError, match="model_path must be the source model's folder"):
        check_model_path(value, "export")


def test_copy_extras_never_replaces_a_file_the_target_holds(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        (src / name).write_text("source")
    (dst / "tokenizer.json").write_text("target")
    assert copy_extras(str(src), str(dst)) == ["generation_config.json"]
    assert (dst / "tokenizer.json").read_text() == "target"
    assert (dst / "generation_config.json").read_text() == "source"


def test_the_header_of_an_empty_tensor_is_read(tmp_path):
    save_file({"a.weight": torch.zeros(0, 4), "a.bias": torch.zeros(4)},
              str(tmp_path / "model.safetensors"))
    got = safetensors_headers(tmp_path, "check")
    assert {name: shape for name, (_, _, shape) in got.items()} == {
        "a.weight": [0, 4], "a.bias": [4]}


@pytest.mark.parametrize("shape", [[-4], [2, -2], [2.0], [True], [2, False]])
def test_a_header_shape_of_no_natural_numbers_is_refused(tmp_path, shape):
    """JSON true / false too, as safetensors refuses them ("expected usize"), though Python's
    bool is an int."""
    header = json.dumps({"a.weight_scale": {"dtype": "F32", "shape": shape,
                                            "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match="tensor 'a.weight_scale' has no valid dtype and shape"):
        safetensors_headers(tmp_path, "check")


@pytest.mark.parametrize(("fmt", "lo", "hi"), [("int8", -128, 127), ("uint8", 0, 255),
                                                ("int4", -8, 7)])
def test_a_zero_point_at_either_end_of_its_range_is_one(fmt, lo, hi):
    spec = QuantSpec(fmt, Tensor(), symmetric=False)
    assert zero_point_problem("x.input_zero_point", torch.tensor([lo, hi]), spec) is None
    for out in (lo - 1, hi + 1):
        assert "no integers in" in zero_point_problem("x.input_zero_point",
                                                      torch.tensor([out]), spec)


@pytest.mark.parametrize("name", ["model.experts[0].w1", "lm_head?", "a*b"])
def test_an_exact_name_with_a_glob_character_is_escaped(name):
    import re

    pattern = exact_pattern(name)
    assert pattern.startswith("re:") and re.fullmatch(pattern[3:], name)
    assert not re.fullmatch(pattern[3:], name.replace("0", "1").replace("?", "x") + "x")


def test_all_nan_shards_are_reported_non_finite_not_as_differing(tmp_path):
    t = nvfp4_checkpoint(layers=1)
    for shard in ("gate_proj", "up_proj"):
        t[MLP.format(0, shard) + ".input_global_scale"] = torch.tensor([float("nan")])
    problems = check(write(tmp_path / "nan", t))
    assert sorted(p["tensor"] for p in problems) == [
        MLP.format(0, s) + ".input_global_scale" for s in ("gate_proj", "up_proj")]
    assert all(p.get("non_finite") for p in problems)


def test_fp8_shards_of_per_tensor_and_per_channel_weights_share_no_weight_scale(tmp_path):
    """Only shards all per-tensor share one weight scale (vLLM re-quantizes those): a
    per-tensor q_proj beside per-channel k / v is a scheme problem, not a scale to compare."""
    groups = {"group_0": _fp8_group(["Linear"], "channel"),
              "group_1": _fp8_group([r"re:.*self_attn\.q_proj$"], "tensor")}
    t = {}
    for p, scale in (("q_proj", torch.tensor([0.5])), ("k_proj", torch.full((4, 1), 0.25)),
                     ("v_proj", torch.full((4, 1), 0.25))):
        t[f"{ATTN.format(0, p)}.weight"] = torch.zeros(4, 4).to(torch.float8_e4m3fn)
        t[f"{ATTN.format(0, p)}.weight_scale"] = scale
    problems = check(write(tmp_path / "fp8", t, groups=groups, fmt="float-quantized"))
    assert [(p["group"], p["tensor"]) for p in problems if p["tensor"] != "config"] == [
        ("model.layers.0.self_attn.qkv_proj", "scheme")]


def test_a_nan_expert_input_scale_is_no_disagreement_among_the_others(tmp_path):
    t = _fp8_experts()
    t[f"{EXPERTS}.1.down_proj.input_scale"] = torch.tensor([float("nan")])
    problems = check(_write(tmp_path / "nan", t))
    assert [(p["tensor"], p.get("non_finite")) for p in problems] == [
        (f"{EXPERTS}.1.down_proj.input_scale", True)]


def test_a_disagreement_one_float32_ulp_apart_prints_both_values_apart():
    a = torch.tensor(0.1234567, dtype=torch.float32)
    b = torch.nextafter(a, torch.tensor(1.0))
    line = format_problems([{"group": "m.qkv_proj", "layers": ["m.q_proj", "m.k_proj"],
                             "tensor": "input_scale",
                             "values": {"m.q_proj": float(a), "m.k_proj": float(b)}}])
    shown = dict(kv.split("=") for kv in line.split(": ")[-1].split(", "))
    as_f32 = {k: torch.tensor(float(v), dtype=torch.float32) for k, v in shown.items()}
    assert as_f32["m.q_proj"] == a and as_f32["m.k_proj"] == b  # float32 reads them back


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    """A tiny Llama exported W8A8 (symmetric int8 weights per channel, static inputs)."""
    model, batches = tiny_llama()
    out = tmp_path_factory.mktemp("ct") / "w8a8"
    calibrate(model, batches, "w8a8", progress=False).export(model, out)
    return out


def _with_record(src, dst, **record):
    folder = shutil.copytree(src, dst)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantscope"].update(record)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _read(folder):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        back = Calibration.from_compressed_tensors(folder)
    return back, [str(w.message) for w in said if "changes the weights" in str(w.message)]


def test_a_recorded_source_folder_is_the_info_model_only_where_it_exists(w8a8, tmp_path):
    source = tmp_path / "float"
    source.mkdir()
    here = _with_record(w8a8, tmp_path / "here", model=str(source), smoothed=False)
    gone = _with_record(w8a8, tmp_path / "gone", model=str(tmp_path / "nowhere"))
    assert _read(here)[0].info["model"] == str(source)
    assert _read(gone)[0].info["model"] == str(gone)  # another machine's path: the folder


def test_a_smoothed_record_reads_with_the_warning_and_the_checkpoint_as_model(w8a8,
                                                                              tmp_path):
    source = tmp_path / "float"
    source.mkdir()
    folder = _with_record(w8a8, tmp_path / "smoothed", model=str(source), smoothed=True)
    back, said = _read(folder)
    assert len(said) == 1 and "quantscope's SmoothQuant" in said[0], said
    assert back.info["model"] == str(folder)


def test_a_quantized_layer_without_its_weight_scale_is_refused_naming_it(w8a8, tmp_path):
    layer = "model.layers.0.mlp.up_proj"
    folder = shutil.copytree(w8a8, tmp_path / "noscale")
    (f,) = folder.glob("*.safetensors")
    t = load_file(f)
    del t[f"{layer}.weight_scale"]
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{layer}: its group quantizes the weight, but no "
                                         rf"weight_scale is stored"):
        Calibration.from_compressed_tensors(folder)


def test_a_mixed_precision_config_of_group_formats_reads(w8a8, tmp_path):
    """llm-compressor's config of several formats: "mixed-precision" on top, each group's own."""
    def edit(qc):
        for group in qc["config_groups"].values():
            group["format"] = qc["format"]
        qc["format"] = "mixed-precision"
    back = Calibration.from_compressed_tensors(_edited(w8a8, tmp_path / "mixed", edit))
    assert back.quantizes_like(Calibration.from_compressed_tensors(w8a8))


def test_a_config_of_no_groups_and_no_kv_cache_is_refused_as_matching_nothing(w8a8, tmp_path):
    folder = _edited(w8a8, tmp_path / "none", lambda qc: qc.update(config_groups={}))
    with pytest.raises(ValueError, match=r"no module of .* matches the config groups' targets"):
        Calibration.from_compressed_tensors(folder)


@pytest.mark.parametrize("key", ["model.norm.input_scale", "model.layers.7.mlp.x.weight_scale"])
def test_a_scale_no_read_layer_owns_is_refused_not_dropped(w8a8, tmp_path, key):
    """A scale of a module the targets miss or of no module: apply() would run without it."""
    folder = shutil.copytree(w8a8, tmp_path / "stray")
    (f,) = folder.glob("*.safetensors")
    t = load_file(f)
    assert key not in t
    t[key] = torch.ones(1)
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{key}' belongs to no layer of the model"):
        Calibration.from_compressed_tensors(folder)


def test_packed_zero_points_of_a_groups_own_pack_format_are_not_read_as_values(tmp_path):
    """llm-compressor's mixed-precision config names pack-quantized in the group, not on top:
    its packed int32 zero points are left to the reader as the top-level format's are."""
    out = _exported(tmp_path, QuantSpec("int4", Group(16), symmetric=False))
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["format"] == "pack-quantized"
    for group in qc["config_groups"].values():
        group["format"] = "pack-quantized"
    qc["format"] = "mixed-precision"
    (out / "config.json").write_text(json.dumps(cfg))
    assert _zero_points(out) == []
    Calibration.from_compressed_tensors(out)  # the reader checks them unpacked
