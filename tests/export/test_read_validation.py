"""Reading a compressed-tensors folder back validates it (issue 37 rows 3, 5, 10, 11, 12;
row 4, MoE read-back: test_read_experts.py).

``Calibration.from_compressed_tensors`` and ``check`` share one validation
(``quantscope.exporters.read_checks``): every damaged scale, config field or header is a
``ValueError`` naming the file and the key; nothing NaN reaches ``apply()``.
"""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors.torch import load_file, save_file

from quantscope.calibration import Calibration, calibrate
from quantscope.exporters import check

torch.set_num_threads(1)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    return model, [{"input_ids": torch.randint(0, 50, (1, 8), generator=g)} for _ in range(2)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Llama exported W8A8 (per-channel weight scales, static input scales)."""
    model, batches = tiny_llama()
    calib = calibrate(model, batches, "w8a8", progress=False)
    out = tmp_path_factory.mktemp("ct") / "llama"
    calib.export(model, out)
    return out


def _copy(src, dst):
    import shutil

    return shutil.copytree(src, dst)


def _edit_tensor(folder, key, fn):
    (f,) = folder.glob("*.safetensors")
    t = load_file(f)
    t[key] = fn(t[key].clone())
    save_file(t, f, metadata={"format": "pt"})


def _edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_the_export_reads_back_and_checks_clean(exported):
    calib = Calibration.from_compressed_tensors(exported)
    assert calib.states
    assert check(exported) == []


_W = "model.layers.0.self_attn.q_proj.weight_scale"
_I = "model.layers.0.mlp.down_proj.input_scale"


@pytest.mark.parametrize("key", [_W, _I])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_scale_is_refused_naming_file_tensor_and_value(exported, tmp_path, key, value):
    folder = _copy(exported, tmp_path / "bad")

    def poison(t):
        t.reshape(-1)[0] = value
        return t
    _edit_tensor(folder, key, poison)
    with pytest.raises(ValueError, match=rf"model.safetensors: {key} holds") as e:
        Calibration.from_compressed_tensors(folder)
    assert repr(value) in str(e.value)
    problems = check(folder)
    assert [p["tensor"] for p in problems] == [key]


@pytest.mark.extended  # an interpreter end to end
def test_cli_check_exits_1_naming_a_nan_per_channel_scale(exported, tmp_path):
    folder = _copy(exported, tmp_path / "bad")
    _edit_tensor(folder, _W, lambda t: t.fill_(float("nan")))
    assert torch.load is not None and load_file(folder / "model.safetensors")[_W].numel() > 1
    r = subprocess.run([sys.executable, "-m", "quantscope", "check", str(folder)],
                       capture_output=True, text=True, check=False, timeout=600)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert _W in r.stdout and "agree" not in r.stdout


def test_architectures_never_call_other_transformers_functions(exported, tmp_path,
                                                               monkeypatch):
    folder = _copy(exported, tmp_path / "bad")
    _edit_config(folder, lambda c: c.__setitem__("architectures", ["set_seed"]))
    called = []
    monkeypatch.setattr(transformers, "set_seed", lambda *a, **k: called.append(a))
    with pytest.raises(ValueError, match="config.json: architectures"):
        Calibration.from_compressed_tensors(folder)
    assert not called


@pytest.mark.parametrize("where", ["top", "group"])
def test_a_format_naming_a_python_file_runs_nothing(exported, tmp_path, where):
    """compressed-tensors' registry executes a ``"file.py:value"`` name: a config.json's
    format must never reach it (the file here would leave a mark)."""
    plugin, mark = tmp_path / "plugin.py", tmp_path / "ran"
    plugin.write_text(f"open({str(mark)!r}, 'w').close()\nx = 1\n")
    name = f"{plugin}:x"
    folder = _copy(exported, tmp_path / "bad")
    _edit_config(folder, lambda c: c["quantization_config"].__setitem__("format", name)
                 if where == "top" else next(iter(c["quantization_config"]["config_groups"]
                                                  .values())).__setitem__("format", name))
    for read in (Calibration.from_compressed_tensors, check):  # a group's: an enum there
        with pytest.raises(ValueError, match=r"(?s)no compressed-tensors format|format.*Input"):
            read(folder)
    assert not mark.exists()


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["quantization_config"].__setitem__("format", "bogus-format"), "format"),
    (lambda c: next(iter(c["quantization_config"]["config_groups"].values())).__setitem__(
        "targets", ["NoSuchLayer"]), "targets"),
    (lambda c: c["quantization_config"].__setitem__("config_groups", 3), "config_groups"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["input_activations"]
     .__setitem__("num_bits", 99), "config_groups.group_0: .*bits"),  # make fuzz
    (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        weights=None, input_activations=None), "config_groups.group_0: .*at least one"),
    (lambda c: c["quantization_config"]["config_groups"].__setitem__("group_0", []),
     "quantization_config is not valid"),  # make fuzz: compressed-tensors 0.20.1, a KeyError
    (lambda c: c.__setitem__("quantscope", 5), None),
    (lambda c: c.__setitem__("quantization_config", []), "quantization_config"),
])
def test_damaged_config_is_refused_naming_the_field(exported, tmp_path, edit, field):
    folder = _copy(exported, tmp_path / "bad")
    _edit_config(folder, edit)
    if field is None:  # harmless damage: the record is ignored
        Calibration.from_compressed_tensors(folder)
        return
    with pytest.raises(ValueError, match=field) as e:
        Calibration.from_compressed_tensors(folder)
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("key, value", [("model_type", None), ("num_attention_heads", 0)])
def test_config_transformers_cannot_read_is_refused_naming_the_file(exported, tmp_path, key,
                                                                     value):
    # found by `make fuzz`: transformers' own error for a null model_type names no file (and
    # empty_model let its ZeroDivisionError through)
    from quantscope.calibration.run.checkpoint import empty_model

    folder = _copy(exported, tmp_path / "bad")
    _edit_config(folder, lambda c: c.__setitem__(key, value))
    for read, who in ((Calibration.from_compressed_tensors, "from_compressed_tensors"),
                      (empty_model, "empty_model")):
        with pytest.raises(ValueError, match=rf"{who}: .*config.json: transformers cannot"):
            read(folder)


@pytest.mark.parametrize("damage", [b"", b"\xff" * 8 + b"{}", b"\x10\x00\x00\x00\x00\x00\x00\x00[1,2]"
                                    + b" " * 11, b"\x02\x00\x00\x00\x00\x00\x00\x00{}"])
def test_damaged_safetensors_is_refused_by_both_readers(exported, tmp_path, damage):
    folder = _copy(exported, tmp_path / "bad")
    (folder / "model.safetensors").write_bytes(damage)
    for read in (Calibration.from_compressed_tensors, check):
        with pytest.raises(ValueError, match="safetensors|tensors"):
            read(folder)


def _group(c):
    return next(iter(c["quantization_config"]["config_groups"].values()))


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["quantization_config"].__setitem__("format", "bogus-format"), "format"),
    (lambda c: _group(c).__setitem__("format", "bogus-format"), "config_groups.group_0"),
    (lambda c: c["quantization_config"].__setitem__("config_groups", {"g": [1]}),
     "config_groups"),
    (lambda c: _group(c)["weights"].__setitem__("num_bits", "eight"), "num_bits"),
])
def test_check_validates_the_config_as_the_reader_does(exported, tmp_path, edit, field):
    # one validation (read_checks.parse_quant_config): check no longer says "shards agree"
    folder = _copy(exported, tmp_path / "bad")
    _edit_config(folder, edit)
    for read in (Calibration.from_compressed_tensors, check):
        with pytest.raises(ValueError, match=field) as e:
            read(folder)
        assert "config.json" in str(e.value)


def _tensors(folder):
    (f,) = folder.glob("*.safetensors")
    return load_file(f)


@pytest.mark.parametrize("field, value, why", [
    ("num_bits", 4, (r"weight holds codes in \[-\d+, \d+\], outside the config's weights "
                     r"\(int4 .*\) range \[-8, 7\]")),
    ("num_bits", 16, (r"weight is torch.int8 \[32, 32\], but the config's weights "
                      r"\(int16 .*\) are stored as torch.int16")),
    ("type", "float", r"format 'int-quantized' does not store the config's weights \(fp8"),
])
def test_a_config_that_contradicts_the_stored_weights_is_refused(exported, tmp_path, field,
                                                                  value, why):
    # issue 37 probing: the w8a8 int8 codes read as an int4 (or fp8) calibration, the int8
    # scales carried over: apply() was 0.067 off compressed-tensors' own decompression
    folder = _copy(exported, tmp_path / "bad")
    _edit_config(folder, lambda c: _group(c)["weights"].__setitem__(field, value))
    with pytest.raises(ValueError, match=rf"model.layers.0.self_attn.q_proj: {why}"):
        Calibration.from_compressed_tensors(folder)


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.reshape(1, -1), r"weight_scale has shape \[1, 32\], expected \[32, 1\]"),
    (lambda t: t.to(torch.int32) + 1, r"weight_scale is torch.int32, not a floating-point"),
])
def test_a_scale_of_another_shape_or_dtype_is_refused_not_reshaped(exported, tmp_path, edit,
                                                                    why):
    # a [1, out] per-channel scale was reshaped to [out, 1]: compressed-tensors broadcasts it
    # along the input features, so the two readers' weights differed by 40 % of the max
    folder = _copy(exported, tmp_path / "bad")
    _edit_tensor(folder, _W, edit)
    with pytest.raises(ValueError, match=rf"q_proj.{why}"):
        Calibration.from_compressed_tensors(folder)


def test_a_tensor_in_two_files_is_refused_by_both_readers(exported, tmp_path):
    # the reader merged the files in name order: a second copy won over the one a runtime
    # loads
    folder = _copy(exported, tmp_path / "bad")
    save_file({_W: _tensors(folder)[_W] * 4}, folder / "zz-extra.safetensors")
    for read in (Calibration.from_compressed_tensors, check):
        with pytest.raises(ValueError, match=rf"tensor '{_W}' is in both .*model.safetensors "
                                             rf"and .*zz-extra.safetensors"):
            read(folder)


@pytest.fixture(scope="module")
def exported_nvfp4_kv(tmp_path_factory):
    """The tiny Llama exported NVFP4 weights, and (a second folder) FP8 with KV scales."""
    model, batches = tiny_llama()
    out = tmp_path_factory.mktemp("ct")
    for name in ("nvfp4", "fp8-kv"):
        calibrate(model, batches, name, progress=False).export(model, out / name)
    return out


def test_nvfp4_without_its_weight_global_scale_is_refused(exported_nvfp4_kv, tmp_path):
    # it read as global scale None, and apply() zeroed the layer
    folder = _copy(exported_nvfp4_kv / "nvfp4", tmp_path / "bad")
    _edit_tensor_set(folder, lambda t: t.pop(_W.replace("weight_scale", "weight_global_scale")))
    with pytest.raises(ValueError, match=r"q_proj has no weight_global_scale"):
        Calibration.from_compressed_tensors(folder)


def test_nvfp4_packed_as_fp4_read_as_fp8_is_refused(exported_nvfp4_kv, tmp_path):
    folder = _copy(exported_nvfp4_kv / "nvfp4", tmp_path / "bad")
    _edit_config(folder, lambda c: _group(c)["weights"].__setitem__("num_bits", 8))
    with pytest.raises(ValueError, match=r"format 'nvfp4-pack-quantized' does not store the "
                                         r"config's weights \(fp8_e4m3"):
        Calibration.from_compressed_tensors(folder)


_ATTN = "model.layers.0.self_attn"


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.__setitem__(f"{_ATTN}.k_scale", torch.tensor([1.0, 2.0])),
     rf"{_ATTN}.k_scale has shape \[2\], expected \[1\]"),
    (lambda t: t.pop(f"{_ATTN}.v_scale"), rf"{_ATTN} has no v_scale beside its other"),
    (lambda t: t.__setitem__("model.layers.7.self_attn.k_scale", torch.tensor([1.0])),
     r"'model.layers.7.self_attn.k_scale' belongs to no layer of the model"),
    (lambda t: [t.pop(k) for k in list(t) if k.endswith(("k_scale", "v_scale"))],
     r"kv_cache_scheme is static but the attention modules \['model.layers.0.self_attn'"),
])
def test_damaged_kv_cache_scales_are_refused(exported_nvfp4_kv, tmp_path, edit, why):
    # each read without a word (a cache left in float, a layer the model lacks) or raised a
    # bare RuntimeError
    folder = _copy(exported_nvfp4_kv / "fp8-kv", tmp_path / "bad")
    assert f"{_ATTN}.k_scale" in _tensors(folder)
    _edit_tensor_set(folder, edit)
    with pytest.raises(ValueError, match=why):
        Calibration.from_compressed_tensors(folder)


def _edit_tensor_set(folder, fn):
    (f,) = folder.glob("*.safetensors")
    t = load_file(f)
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def exported_schemes(tmp_path_factory):
    """The tiny Llama exported as compressed-tensors' MXFP4A16 (E8M0 scales as uint8 codes),
    FP8_DYNAMIC (float8 weights) and W4A16_ASYM (packed int4 zero points)."""
    from quantscope.calibration.recipe import scheme, with_group_size

    model, batches = tiny_llama()
    out = tmp_path_factory.mktemp("ct")
    for name in ("MXFP4A16", "FP8_DYNAMIC", "W4A16_ASYM"):
        recipe = scheme(name, ignore=("lm_head",))
        if name == "W4A16_ASYM":
            recipe = with_group_size(recipe, 16)  # the tiny model's 32 columns
        calibrate(model, batches, recipe, progress=False).export(model, out / name)
    return out


def test_an_e8m0_nan_code_is_refused_by_both_readers(exported_schemes, tmp_path):
    # found by probing: the uint8 code 255 (E8M0 NaN, OCP MX v1.0 5.4.1) was checked as the
    # integer 255.0, read as the scale inf, and apply() gave non-finite weights
    folder = _copy(exported_schemes / "MXFP4A16", tmp_path / "bad")
    assert _tensors(folder)[_W].dtype == torch.uint8
    _edit_tensor(folder, _W, lambda t: t.index_put_((torch.tensor(0), torch.tensor(0)),
                                                    torch.tensor(255, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=rf"model.safetensors: {_W} holds NaN or inf \(nan\)"):
        Calibration.from_compressed_tensors(folder)
    assert [(p["tensor"], p.get("non_finite")) for p in check(folder)] == [(_W, True)]


def test_an_e8m0_zero_code_is_the_scale_2_to_the_minus_127(exported_schemes, tmp_path):
    # code 0 is 2 ** -127 (an all-zero block's scale), not the scale 0
    folder = _copy(exported_schemes / "MXFP4A16", tmp_path / "zero")
    _edit_tensor(folder, _W, lambda t: t.index_put_((torch.tensor(0), torch.tensor(0)),
                                                    torch.tensor(0, dtype=torch.uint8)))
    assert check(folder) == []
    calib = Calibration.from_compressed_tensors(folder)
    scale = calib.states["model.layers.0.self_attn.q_proj"]["weight"].qparams.scale
    assert float(scale.reshape(-1)[0]) == 2.0 ** -127


def test_decoded_scales_are_checked_too(exported_schemes, tmp_path, monkeypatch):
    # the stored codes are checked as loaded; what compressed-tensors decodes them to is
    # checked again (code 255 decodes to inf), whoever loaded the tensors
    from pathlib import Path

    from quantscope.exporters import read

    folder = _copy(exported_schemes / "MXFP4A16", tmp_path / "bad")
    _edit_tensor(folder, _W, lambda t: t.index_put_((torch.tensor(0), torch.tensor(0)),
                                                    torch.tensor(255, dtype=torch.uint8)))
    monkeypatch.setattr(read, "load_checked_tensors",
                        lambda p, who: load_file(Path(p, "model.safetensors")))
    with pytest.raises(ValueError, match=r"self_attn.q_proj: weight_scale holds NaN or inf"):
        Calibration.from_compressed_tensors(folder)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_a_float8_nan_weight_code_is_refused(exported_schemes, tmp_path, code):
    # found by probing: int codes out of range were refused, float8 NaN codes read without a
    # word (compressed-tensors decompresses them to NaN weights)
    folder = _copy(exported_schemes / "FP8_DYNAMIC", tmp_path / "bad")
    key = _W.replace("weight_scale", "weight")
    assert _tensors(folder)[key].dtype == torch.float8_e4m3fn

    def nan_code(t):
        t.view(torch.uint8)[1, 2] = code
        return t
    _edit_tensor(folder, key, nan_code)
    with pytest.raises(ValueError, match=r"\*.safetensors: model.layers.0.self_attn.q_proj: "
                                         r"weight holds 1 NaN / inf codes \(the first at "
                                         r"\[1, 2\]\)"):
        Calibration.from_compressed_tensors(folder)


def test_a_zero_point_of_another_dtype_is_refused_naming_layer_and_tensor(exported_schemes,
                                                                          tmp_path):
    # found by probing: compressed-tensors' own text ("Expected torch.int32 but got
    # torch.int8, Aborting unpack.") came through, naming neither
    folder = _copy(exported_schemes / "W4A16_ASYM", tmp_path / "bad")
    key = _W.replace("weight_scale", "weight_zero_point")
    packed = _tensors(folder)[key]
    assert packed.dtype == torch.int32
    rows, groups = _tensors(folder)[_W].shape  # the unpacked zero points' shape
    _edit_tensor(folder, key, lambda t: torch.zeros(rows, groups, dtype=torch.int8))
    with pytest.raises(ValueError, match=(
            rf"\*.safetensors: model.layers.0.self_attn.q_proj: weight_zero_point is "
            rf"torch.int8 \[{rows}, {groups}\], but the config's weights \(int4 .*\) are "
            rf"stored as torch.int32 \[{packed.shape[0]}, {packed.shape[1]}\]")):
        Calibration.from_compressed_tensors(folder)


_Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("leaf, value, why", [
    ("weight_zero_point", torch.full((32, 1), 3, dtype=torch.int8),
     r"the config's weight \(int8 channel:0 sym\) is symmetric: it has no zero point"),
    ("weight_zero_point", torch.full((32, 1), 3.0),
     r"the config's weight \(int8 channel:0 sym\) is symmetric: it has no zero point"),
    ("weight_zero_point", torch.zeros(32, 1, dtype=torch.int8),
     r"the config's weight \(int8 channel:0 sym\) is symmetric"),
    ("input_zero_point", torch.zeros(1, dtype=torch.int8),
     r"the config's input \(int8 tensor sym\) is symmetric"),
    ("weight_global_scale", torch.tensor([7.0]),
     r"the config's weight \(int8 channel:0 sym\) has no global scale"),
    ("bogus_scale", torch.ones(1), r"the config's scheme has no such tensor"),
    ("output_scale", torch.ones(1), r"the config's scheme has no such tensor"),
])
def test_a_quantization_tensor_the_scheme_has_not_is_refused(exported, tmp_path, leaf, value,
                                                             why):
    # found by probing: a zero point or a global scale on a symmetric int8 layer was read and
    # applied (logits 0.002-0.005 off), while compressed-tensors never writes one (its
    # compressors drop a symmetric zero point) and transformers' runtime ignores it; an
    # unknown *_scale was dropped without a word
    folder = _copy(exported, tmp_path / "bad")
    assert f"{_Q}.{leaf}" not in _tensors(folder)
    _edit_tensor_set(folder, lambda t: t.__setitem__(f"{_Q}.{leaf}", value))
    with pytest.raises(ValueError, match=(
            rf"\*.safetensors: {_Q}: {leaf} is stored, but {why}.*compressed-tensors writes "
            rf"only \['input_scale', 'weight_scale'\]")):
        Calibration.from_compressed_tensors(folder)


@pytest.mark.parametrize("key, why", [
    (f"{_ATTN}.k_scale", (r"is a KV-cache scale, but quantization_config has no "
                          r"kv_cache_scheme")),
    ("model.layers.7.mlp.x.weight_zero_point", r"belongs to no layer of the model"),
])
def test_a_quantization_tensor_no_layer_reads_is_refused(exported, tmp_path, key, why):
    # both were dropped without a word (docs/SECURITY.md: refused rather than dropped)
    folder = _copy(exported, tmp_path / "bad")
    _edit_tensor_set(folder, lambda t: t.__setitem__(key, torch.ones(1)))
    with pytest.raises(ValueError, match=rf"tensor '{key}' {why}"):
        Calibration.from_compressed_tensors(folder)


@pytest.fixture(scope="module")
def exported_asym(tmp_path_factory):
    """The tiny Llama exported with asymmetric int8 weights (per channel) and inputs (static
    per tensor): int-quantized, integer zero points."""
    from quantscope import Channel, QuantSpec, Tensor
    from quantscope.calibration import Recipe, Role, Rule

    model, batches = tiny_llama()
    recipe = Recipe((Rule(("Linear",),
                          weight=Role(QuantSpec("int8", Channel(0), symmetric=False), "minmax"),
                          input=Role(QuantSpec("int8", Tensor(), symmetric=False), "minmax")),),
                    ("lm_head",), "asym")
    calib = calibrate(model, batches, recipe, progress=False)
    out = tmp_path_factory.mktemp("ct") / "asym"
    calib.export(model, out)
    return calib, out


def test_asymmetric_zero_points_read_back(exported_asym):
    calib, folder = exported_asym
    back = Calibration.from_compressed_tensors(folder)
    for role in ("weight", "input"):
        want, got = calib.states[_Q][role].qparams, back.states[_Q][role].qparams
        assert bool(want.zero_point.ne(0).any())  # the check below is on real zero points
        assert torch.equal(got.zero_point, want.zero_point.to(torch.int32).reshape(
            got.zero_point.shape))


@pytest.mark.parametrize("leaf, why", [
    ("weight_zero_point", (r"weight_zero_point is torch.float32 \[32, 1\], but the "
                           r"config's weights \(int8 channel:0 asym\) are stored as "
                           r"torch.int8 \[32, 1\]")),
    ("input_zero_point", (r"input_zero_point is torch.float32, but compressed-tensors stores "
                          r"the config's input zero points \(int8 tensor asym\) as "
                          r"torch.int8")),
])
def test_a_float_zero_point_of_an_integer_scheme_is_refused(exported_asym, tmp_path, leaf,
                                                            why):
    # found by probing: compressed-tensors writes the int8 zero points as int8 (its
    # ``zp_dtype``); a float32 copy of them was read as if it were
    folder = _copy(exported_asym[1], tmp_path / "bad")
    assert _tensors(folder)[f"{_Q}.{leaf}"].dtype == torch.int8
    _edit_tensor(folder, f"{_Q}.{leaf}", lambda t: t.float())
    with pytest.raises(ValueError, match=rf"{_Q}[:.] ?{why}"):
        Calibration.from_compressed_tensors(folder)


_GPTQ_RECIPE = """default_stage:
  default_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
    GPTQModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8
"""


@pytest.mark.parametrize("recipe, warned", [
    (_GPTQ_RECIPE, "GPTQModifier (its recipe.yaml), SmoothQuantModifier (its recipe.yaml)"),
    (_GPTQ_RECIPE.replace("SmoothQuantModifier:\n      smoothing_strength: 0.8\n    ", "")
     .replace("GPTQModifier", "QuantizationModifier"), None),
    ("# GPTQModifier: in a comment only\n", None),
])
def test_a_checkpoint_whose_recipe_rewrote_the_weights_is_read_with_a_warning(
        exported, tmp_path, recipe, warned):
    # found by probing: qparams read from llm-compressor's GPTQ checkpoint, applied to the
    # float model, ran 0.18 off transformers' load of it, without a word
    import warnings

    folder = _copy(exported, tmp_path / "llmc")
    (folder / "recipe.yaml").write_text(recipe)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        back = Calibration.from_compressed_tensors(folder)
    texts = [str(w.message) for w in seen if "changes the weights" in str(w.message)]
    if warned is None:
        assert texts == []
    else:
        assert len(texts) == 1 and f"was made by {warned}" in texts[0]
        assert back.info["model"] == str(folder)
    assert back.states.keys() == Calibration.from_compressed_tensors(exported).states.keys()
