"""compressed-tensors folders read or written wrong without a word (probe s39): a
``quantization_config`` whose transforms, pruned experts or sparse weights quantscope does
not run; a float64 scale float32 cannot hold; MXFP8 scales computed at run time with another
rounding; and an export over the folder the model was loaded from when ``model_path`` names
another."""

import json
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors.torch import load_file, save_file

from quantscope.calibration import Calibration, calibrate

torch.set_num_threads(1)


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, [{"input_ids": torch.randint(0, 50, (1, 8))} for _ in range(2)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    out = {}
    for name in ("w8a8", "mxfp4"):
        model, batches = _tiny_llama()
        folder = tmp_path_factory.mktemp("ct") / name
        calibrate(model, batches, name, progress=False).export(  # mxfp4's inputs: floor
            model, folder, allow_lossy=name == "mxfp4")  # rule, written as theirs (even)
        out[name] = folder
    return out


def _edited(src, dst, edit):
    folder = shutil.copytree(src, dst)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


HADAMARD = {"config_groups": {"R4": {"type": "hadamard", "apply": [
    {"targets": ["re:.*down_proj$"], "location": "input"},
    {"targets": ["re:.*down_proj$"], "location": "weight_input", "inverse": True}]}}}


@pytest.mark.parametrize("key,value", [
    ("transform_config", HADAMARD),
    ("moe_sparsity_config", {"method": "prune", "num_experts": [None]}),
    ("sparsity_config", {"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                         "targets": ["Linear"], "ignore": []}),
])
def test_sections_quantscope_does_not_run_are_refused(exports, tmp_path, key, value):
    folder = _edited(exports["w8a8"], tmp_path / "x", lambda qc: qc.update({key: value}))
    with pytest.raises(ValueError, match=rf"quantization_config\.{key} is set"):
        Calibration.from_compressed_tensors(folder)


def test_a_dense_sparsity_config_is_read(exports, tmp_path):
    dense = {"format": "dense", "sparsity_structure": "unstructured", "targets": ["Linear"]}
    folder = _edited(exports["w8a8"], tmp_path / "x",
                     lambda qc: qc.update(sparsity_config=dense, transform_config=None))
    back = Calibration.from_compressed_tensors(folder)
    assert back.quantizes_like(Calibration.from_compressed_tensors(exports["w8a8"]))


def _with_f64_scales(src, dst, nudge):
    folder = shutil.copytree(src, dst)
    (f,) = folder.glob("*.safetensors")
    ts = load_file(f)
    for k in [k for k in ts if k.endswith("weight_scale")]:
        ts[k] = ts[k].double() * (1 + nudge)
    save_file(ts, f, metadata={"format": "pt"})
    return folder


def test_a_float64_scale_float32_cannot_hold_is_said_rounded(exports, tmp_path):
    # compressed-tensors keeps a float64 model's scales in float64: read, with a warning
    folder = _with_f64_scales(exports["w8a8"], tmp_path / "x", 2.0 ** -30)
    with pytest.warns(UserWarning, match="float64 scales float32 cannot hold exactly"):
        back = Calibration.from_compressed_tensors(folder)
    assert back.quantizes_like(Calibration.from_compressed_tensors(exports["w8a8"]))


def test_a_float64_scale_of_float32_values_reads_as_them(exports, tmp_path):
    folder = _with_f64_scales(exports["w8a8"], tmp_path / "x", 0.0)
    back = Calibration.from_compressed_tensors(folder)
    assert back.quantizes_like(Calibration.from_compressed_tensors(exports["w8a8"]))


MXFP8_INPUT = {"dynamic": True, "group_size": 32, "num_bits": 8, "strategy": "group",
               "symmetric": True, "type": "float", "scale_dtype": "torch.uint8"}


def _said(folder):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        Calibration.from_compressed_tensors(folder)
    return [str(w.message) for w in said if "compute their scales at run time" in
            str(w.message)]


def test_run_time_mxfp8_scales_are_said_to_round_otherwise(exports, tmp_path):
    def edit(qc):
        for g in qc["config_groups"].values():
            g["input_activations"] = MXFP8_INPUT
    said = _said(_edited(exports["mxfp4"], tmp_path / "x", edit))
    assert len(said) == 1 and "fp8_e4m3" in said[0], said


def test_mxfp4_reads_without_that_warning(exports):
    assert not _said(exports["mxfp4"])


def test_export_never_replaces_the_folder_the_model_came_from(exports, tmp_path):
    model, batches = _tiny_llama()
    source = tmp_path / "float"
    model.save_pretrained(source)
    loaded = shutil.copytree(exports["w8a8"], tmp_path / "loaded")
    model.config._name_or_path = str(loaded)  # as transformers records a folder loaded
    cal = calibrate(model, batches, "w8a8", progress=False)
    before = (loaded / "model.safetensors").read_bytes()
    for kw in ({}, {"model_path": source}):
        with pytest.raises(ValueError, match="is the input"):
            cal.export(model, loaded, overwrite=True, **kw)
    assert (loaded / "model.safetensors").read_bytes() == before


def test_a_sparsity_config_without_a_format_is_read(exports, tmp_path):
    folder = _edited(exports["w8a8"], tmp_path / "x",
                     lambda qc: qc.update(sparsity_config={"sparsity_structure": "unstructured"}))
    Calibration.from_compressed_tensors(folder)


@pytest.mark.parametrize("role", [
    {**MXFP8_INPUT, "dynamic": False},  # stored scales read exactly: nothing to say
    {**MXFP8_INPUT, "num_bits": 6, "type": "float"},  # E2M3: compressed-tensors' own rule
])
def test_only_run_time_mx_roles_of_another_rounding_warn(exports, tmp_path, role):
    from quantscope.calibration import RoleState
    from quantscope.compat.llmcompressor_spec import llmcompressor_spec
    from quantscope.exporters.read import _warn_run_time_mx

    spec = llmcompressor_spec(role, "input")
    state = RoleState(spec, "minmax", "minmax", role["dynamic"])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _warn_run_time_mx({"l": {"input": state}}, "p")
    assert not said, [str(w.message) for w in said]


def test_the_extras_come_from_the_live_models_folder(tmp_path):
    from quantscope.exporters.source_folder import source_dir

    live, recorded = tmp_path / "live", tmp_path / "recorded"
    for d in (live, recorded):
        d.mkdir()
        (d / "config.json").write_text("{}")

    from types import SimpleNamespace

    cal = SimpleNamespace(info={"model": str(recorded)})
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(live)))
    assert source_dir(cal, model, None) == str(live)
