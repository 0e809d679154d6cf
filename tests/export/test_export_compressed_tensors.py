"""Export to compressed-tensors: transformers loads what we write and runs it as quantscope's
QDQ does; the checkpoint reads back into the same calibration; bad targets leave nothing.

Tiny random models from transformers configs (a BertModel, a LlamaForCausalLM) saved to a
temporary folder with a tokenizer beside them; the real demo models are measured by
bench/export_ct.py (docs/guide/deploy.md).
"""

import json
import os
import pathlib
import re
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

import quantscope
from quantscope import QuantSpec, Tensor, Token
from quantscope import presets as P
from quantscope.calibration import Calibration, Recipe, Role, Rule, calibrate, preset
from quantscope.calibration import save as save_calibration

torch.set_num_threads(1)

_FP8_T = QuantSpec("fp8_e4m3", Tensor())
_MX_EVEN = QuantSpec("fp4_e2m1", P.MXFP4.layout, scale="e8m0:even")


def _recipe(weight, inp=None, name="custom", ignore=()):
    return Recipe((Rule(("Linear",), weight=weight, input=inp),), tuple(ignore), name)


#: name -> (recipe, exact): exact schemes match QDQ to float rounding after transformers
#: loads them; fp4 ones go through bf16 in compressed-tensors' decompression (cosine)
SCHEMES = {
    "w8a8": (lambda ig: preset("w8a8", ignore=ig), True),
    "w8a8-dynamic": (lambda ig: preset("w8a8-dynamic", ignore=ig), True),
    "w4a16": (lambda ig: preset("w4a16", ignore=ig), True),
    "w4a16-asym": (lambda ig: preset("w4a16-asym", ignore=ig), True),
    "w4a8": (lambda ig: preset("w4a8", ignore=ig), True),
    "fp8": (lambda ig: preset("fp8", ignore=ig), True),
    "fp8-dynamic": (lambda ig: preset("fp8-dynamic", ignore=ig), True),
    "fp8-tensor": (lambda ig: _recipe(Role(P.FP8_PER_TENSOR, "memoryless_minmax"),
                                      Role(_FP8_T, "minmax"), "fp8-tensor", ig), True),
    "fp8-tensor-dynamic": (lambda ig: _recipe(
        Role(P.FP8_PER_TENSOR, "memoryless_minmax"),
        Role(QuantSpec("fp8_e4m3", Token()), "memoryless_minmax", True), "fp8-td", ig), True),
    "nvfp4": (lambda ig: preset("nvfp4", ignore=ig), False),
    "mxfp4": (lambda ig: _recipe(Role(P.MXFP4, "memoryless_minmax"),
                                 Role(_MX_EVEN, "memoryless_minmax", True), "mxfp4", ig), False),
}
#: transformers 5.24 with compressed-tensors 0.20 (.venv) cannot load asymmetric
#: pack-quantized checkpoints: it builds the zero point unpacked on load (as in llm-compressor
#: issue #1618); the peers' transformers 5.17 / compressed-tensors 0.19 loads ours bitwise
#: (tests/export/test_export_ct_peers.py), and our reader checks them here.
TRANSFORMERS_CANNOT_LOAD = {"w4a16-asym"}


def _tokenizer():
    from quantscope.demo import models

    return transformers.AutoTokenizer.from_pretrained(str(models.default_model_path()))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                  num_attention_heads=4, vocab_size=120,
                                  max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    batches = [{"input_ids": torch.randint(0, 120, (2, 12))} for _ in range(3)]
    return model, str(path), batches


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=120,
                                   max_position_embeddings=64, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    batches = [{"input_ids": torch.randint(0, 120, (2, 12))} for _ in range(3)]
    return model, str(path), batches


def _config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _out(model, batch):
    out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _loaded(path, cls):
    model = cls.from_pretrained(path).eval()
    if hasattr(model, "ct_decompress_hook"):  # fp4 decompresses to bf16: run it in fp32
        model.hf_quantizer.compressor.decompress_model(model)
    torch.nn.Module.float(model)
    return model


def _compare(got, ref, exact):
    if exact:
        assert float((got - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    else:
        cos = torch.nn.functional.cosine_similarity(got.flatten(1), ref.flatten(1))
        assert float(cos.min()) >= 0.999


def _applied(calibration, model, batch, bf16_weights=False):
    """Outputs of the QDQ model; ``bf16_weights``: its QDQ weights rounded to bfloat16, as
    compressed-tensors decompresses fp4 checkpoints on CPU (remove() restores them)."""
    with torch.inference_mode(), calibration.apply(model):
        if bf16_weights:
            for layer in calibration.states:
                w = model.get_submodule(layer).weight
                w.copy_(w.bfloat16().float())
        return _out(model, batch)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_bert_scheme_loads_in_transformers_and_round_trips(bert, tmp_path, name):
    model, src, batches = bert
    make, exact = SCHEMES[name]
    cal = calibrate(model, batches, make(()), progress=False)
    out = quantscope.export(cal, model, tmp_path / "ct", model_path=src)
    ref = _applied(cal, model, batches[0])
    if name not in TRANSFORMERS_CANNOT_LOAD:
        with torch.inference_mode():
            got = _out(_loaded(out, transformers.AutoModel), batches[0])
        _compare(got, ref if exact else _applied(cal, model, batches[0], True), exact)
    back = Calibration.from_compressed_tensors(out)
    assert set(back.states) == set(cal.states)
    assert torch.equal(_applied(back, model, batches[0]), ref)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))  # the source folder's files


@pytest.mark.parametrize("name", ["w8a8", "w4a16", "fp8-dynamic", "nvfp4"])
def test_llama_scheme_loads_in_transformers(llama, tmp_path, name):
    model, src, batches = llama
    make, exact = SCHEMES[name]
    cal = calibrate(model, batches, make(("lm_head",)), progress=False)
    out = cal.export(model, tmp_path / "ct", model_path=pathlib.Path(src))  # a Path too
    assert _config(out)["quantscope"]["model"] == os.fspath(src)
    ref = _applied(cal, model, batches[0])
    with torch.inference_mode():
        got = _out(_loaded(out, transformers.AutoModelForCausalLM), batches[0])
    _compare(got, ref if exact else _applied(cal, model, batches[0], True), exact)
    qc = _config(out)["quantization_config"]
    assert qc["ignore"] == ["lm_head"]
    assert torch.equal(_applied(Calibration.from_compressed_tensors(out), model, batches[0]), ref)


def test_config_and_tensors_are_what_llm_compressor_writes(bert, tmp_path):
    from safetensors import safe_open

    model, _src, batches = bert
    cal = calibrate(model, batches, preset("w8a8", ignore=("pooler.dense",)), progress=False)
    out = quantscope.export(cal, model, tmp_path / "ct")
    cfg = _config(out)
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["quantization_status"] == "compressed" and qc["format"] == "int-quantized"
    assert list(qc["config_groups"]) == ["group_0"]  # one scheme: one group
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and qc["ignore"] == ["pooler.dense"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    assert group["input_activations"]["strategy"] == "tensor"
    assert group["weights"]["observer"] == "memoryless_minmax"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        name = "encoder.layer.0.attention.self.query"
        w, s, i = (f.get_tensor(f"{name}.{k}") for k in ("weight", "weight_scale", "input_scale"))
        assert f"{name}.weight_zero_point" not in f.keys()  # noqa: SIM118
        assert f.get_tensor("pooler.dense.weight").dtype == torch.float32
    st = cal.states[name]
    assert w.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (128, 1)
    assert i.shape == (1,) and torch.equal(i, st["input"].qparams.scale)
    assert torch.equal(s, st["weight"].qparams.scale)
    codes = quantscope.quantize(model.get_submodule(name).weight.detach(),
                                st["weight"].qparams, st["weight"].spec)
    assert torch.equal(w.float(), codes)  # the codes are quantscope's codes


def test_two_schemes_make_two_groups_that_target_their_layers(bert, tmp_path):
    model, _, batches = bert
    recipe = Recipe((Rule(("re:.*attention.*(query|key|value|dense)",), weight=Role(P.INT8_PER_CHANNEL, "memoryless_minmax"),
                          input=Role(QuantSpec("int8", Tensor()), "mse")),
                     Rule(("Linear",), weight=Role(P.INT4_GROUP128, "memoryless_mse"))),
                    ("pooler.dense",), "mixed")
    cal = calibrate(model, batches, recipe, progress=False)
    out = quantscope.export(cal, model, tmp_path / "ct")
    qc = _config(out)["quantization_config"]
    groups = sorted(qc["config_groups"].values(), key=lambda g: g["format"])
    assert [g["format"] for g in groups] == ["int-quantized", "pack-quantized"]
    assert groups[0]["targets"] == sorted(n for n in cal.states if ".attention." in n)
    assert groups[0]["input_activations"]["observer"] == "mse"
    assert groups[1]["weights"]["observer"] == "memoryless_mse"
    assert qc["format"] == "mixed-precision" and qc["ignore"] == ["pooler.dense"]
    ref = _applied(cal, model, batches[0])
    with torch.inference_mode():
        _compare(_out(_loaded(out, transformers.AutoModel), batches[0]), ref, True)
    back = Calibration.from_compressed_tensors(out)
    assert torch.equal(_applied(back, model, batches[0]), ref)


def test_packed_formats_names_and_dtypes(bert, tmp_path):
    from safetensors import safe_open

    model, _, batches = bert
    name = "encoder.layer.0.intermediate.dense"
    expect = {
        "w4a16": {"weight_packed": torch.int32, "weight_shape": torch.int64,
                  "weight_scale": torch.float32},
        "w4a16-asym": {"weight_packed": torch.int32, "weight_zero_point": torch.int32,
                       "weight_scale": torch.float32},
        "nvfp4": {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
                  "weight_global_scale": torch.float32, "input_global_scale": torch.float32},
        "mxfp4": {"weight_packed": torch.uint8, "weight_scale": torch.uint8},
    }
    formats = {"w4a16": "pack-quantized", "w4a16-asym": "pack-quantized",
               "nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
    for scheme, tensors in expect.items():
        cal = calibrate(model, batches, SCHEMES[scheme][0](()), progress=False)
        out = quantscope.export(cal, model, tmp_path / scheme)
        assert _config(out)[
            "quantization_config"]["format"] == formats[scheme]
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            for key, dtype in tensors.items():
                assert f.get_tensor(f"{name}.{key}").dtype == dtype, (scheme, key)
            assert f"{name}.weight" not in f.keys()  # noqa: SIM118
        if scheme == "nvfp4":
            with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
                gs = f.get_tensor(f"{name}.weight_global_scale")
                bs = f.get_tensor(f"{name}.weight_scale").float()
            qp = cal.states[name]["weight"].qparams
            assert torch.equal(gs, qp.global_scale)  # 448 * 6 / amax, ours as is
            assert torch.equal(bs, qp.scale)  # e4m3 block scales; runs as bs / gs


def test_sharded_like_transformers(bert, tmp_path):
    model, _, batches = bert
    cal = calibrate(model, batches, preset("w8a8"), progress=False)
    out = quantscope.export(cal, model, tmp_path / "ct", max_shard_size="100KB")
    files = os.listdir(out)
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    ref = _applied(cal, model, batches[0])
    with torch.inference_mode():
        assert torch.equal(_out(_loaded(out, transformers.AutoModel), batches[0]), ref)
    assert torch.equal(_applied(Calibration.from_compressed_tensors(out), model, batches[0]), ref)


def _quantized_bytes(path, layers):
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if k.rsplit(".", 1)[0] in layers and not k.endswith(".bias"):
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("name,ratio", [("w8a8", 1 / 4), ("w4a16", 1 / 8), ("nvfp4", 1 / 8),
                                        ("fp8-dynamic", 1 / 4)])
def test_checkpoint_size_is_what_the_scheme_promises(bert, tmp_path, name, ratio):
    model, _, batches = bert
    cal = calibrate(model, batches, SCHEMES[name][0](()), progress=False)
    out = quantscope.export(cal, model, tmp_path / "ct")
    fp32 = sum(model.get_submodule(n).weight.numel() * 4 for n in cal.states)
    got = _quantized_bytes(out, set(cal.states)) / fp32
    # scales: one fp32 per row (int8), per 128 (int4), one e4m3 per 16 (nvfp4)
    assert ratio <= got <= ratio * 1.15, got


# ------------------------------------------------------------------ what cannot be written
def test_unsupported_spec_is_refused_before_anything_is_written(bert, tmp_path):
    model, _, batches = bert
    pow2 = QuantSpec("int8", P.INT8_PER_CHANNEL.layout, scale="pow2:round")
    cal = calibrate(model, batches, _recipe(Role(pow2, "memoryless_minmax")), progress=False)
    target = tmp_path / "ct"
    with pytest.raises(ValueError, match=r"layer 'encoder\.layer\.0\.attention\.self\.query' "
                                         r"weight: pow2:round scale encoding"):
        quantscope.export(cal, model, target)
    assert os.listdir(tmp_path) == []
    for spec, feature in [(QuantSpec("uint8", Tensor()), "uint8"),
                          (QuantSpec("fp8_e5m2", Tensor()), "fp8_e5m2"),
                          (P.MXFP8, "MX: mxfp4"), (P.BFP16, "int8_narrow")]:
        cal = calibrate(model, batches, _recipe(Role(spec, "memoryless_minmax")), progress=False)
        with pytest.raises(ValueError, match=feature):
            quantscope.export(cal, model, target)
        assert os.listdir(tmp_path) == []


def test_allow_lossy_writes_and_says_what_changed(bert, tmp_path):
    model, _, batches = bert
    pow2 = QuantSpec("int8", P.INT8_PER_CHANNEL.layout, scale="pow2:round")
    cal = calibrate(model, batches, _recipe(Role(pow2, "memoryless_minmax")), progress=False)
    with pytest.warns(UserWarning, match="pow2:round scale encoding"):
        out = quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
    notes = _config(out)["quantscope"]["lossy"]
    assert len(notes) == len(cal.states) and "plain float scales, in the model's dtype" in notes[0]
    # power-of-two values are exact in fp32: the checkpoint still runs as the QDQ model
    ref = _applied(cal, model, batches[0])
    with torch.inference_mode():
        got = _out(_loaded(out, transformers.AutoModel), batches[0])
    _compare(got, ref, True)


def test_mx_floor_activations_need_allow_lossy(bert, tmp_path):
    model, _, batches = bert
    cal = calibrate(model, batches, preset("mxfp4"), progress=False)  # floor at run time
    with pytest.raises(ValueError, match="E8M0 'floor' rule"):
        quantscope.export(cal, model, tmp_path / "ct")
    with pytest.warns(UserWarning, match="'even' rule"):
        quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)


def test_tied_weight_is_refused(llama, tmp_path):
    model, _, batches = llama
    cal = calibrate(model, batches, preset("w8a8-dynamic"), progress=False)  # with lm_head
    with pytest.raises(ValueError, match=r"layer 'lm_head' weight: a weight tied with "
                                         r"\['model\.embed_tokens'\]"):
        quantscope.export(cal, model, tmp_path / "ct")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layout", ["group:16", "channel"])
def test_fp4_with_fp32_scales_is_refused_not_written_as_nvfp4(bert, tmp_path, layout):
    """Probe: fp4 in groups of 16 with fp32 scales (no global scale) was written as
    nvfp4-pack-quantized, its scales cast to e4m3 (other weights after decompression); per
    channel it failed inside compressed-tensors naming no layer. compressed-tensors writes
    fp4 only as NVFP4 or MXFP4: refused, allow_lossy or not."""
    model, _, batches = bert
    spec = QuantSpec("fp4_e2m1", layout)
    assert spec.scale.kind == "fp32"
    cal = calibrate(model, batches, _recipe(Role(spec, "minmax")), progress=False)
    for allow_lossy in (False, True):
        with pytest.raises(ValueError, match=r"layer 'encoder\.layer\.0\.attention\.self\."
                                             r"query' weight: fp4_e2m1 .* with fp32 scales "
                                             r"\(compressed-tensors writes fp4 only as NVFP4"):
            quantscope.export(cal, model, tmp_path / "ct", allow_lossy=allow_lossy)
    assert os.listdir(tmp_path) == []


def test_nvfp4_input_with_a_global_scale_from_each_call_is_refused(bert, tmp_path):
    """vLLM's NVFP4 layer reads a calibrated input_global_scale; an NVFP4 input whose global
    scale comes from each call (dynamic=True: keep_float's "dynamic" fallback) was written as
    tensor_group "dynamic": true with no input_global_scale."""
    model, _, batches = bert
    nv = P.NVFP4
    cal = calibrate(model, batches, _recipe(Role(nv, "memoryless_minmax"),
                                            Role(nv, "memoryless_minmax", True)), progress=False)
    with pytest.raises(ValueError, match=r"layer 'encoder\.layer\.0\.attention\.self\.query' "
                                         r"input: .* global scale from each call"):
        quantscope.export(cal, model, tmp_path / "ct")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("recipe", "block"), [("nvfp4", 16), ("mxfp4", 32)])
def test_fp4_blocks_that_do_not_tile_the_columns_are_refused_naming_the_layer(tmp_path,
                                                                             recipe, block):
    """Probe: 88 columns calibrate in NVFP4 / MX blocks (the last one partial), but
    compressed-tensors packs whole blocks only and failed with a message naming no layer."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=88, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=40, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert 88 % block
    cal = calibrate(model, [{"input_ids": torch.randint(0, 40, (2, 8))}], preset(recipe),
                    progress=False)
    with pytest.raises(ValueError, match=rf"layer 'model\.layers\.0\.mlp\.down_proj' weight: "
                                         rf"88 columns .* not a multiple of the block size "
                                         rf"{block}"):
        quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
    assert os.listdir(tmp_path) == []


def test_channel_minus_2_weights_write_as_channel_0(bert, tmp_path):
    """Probe: Channel(-2) was refused as having no equivalent; on a 2-D weight it is the rows,
    Channel(0): the same checkpoint tensors, strategy channel."""
    from safetensors.torch import load_file

    from quantscope import Channel

    model, _, batches = bert
    tensors = {}
    for axis in (0, -2):
        spec = QuantSpec("int8", Channel(axis))
        cal = calibrate(model, batches, _recipe(Role(spec, "minmax")), progress=False)
        out = quantscope.export(cal, model, tmp_path / f"ct{axis}")
        groups = _config(out)["quantization_config"]["config_groups"]
        assert [g["weights"]["strategy"] for g in groups.values()] == ["channel"]
        tensors[axis] = load_file(os.path.join(out, "model.safetensors"))
    assert tensors[0].keys() == tensors[-2].keys()
    assert all(torch.equal(tensors[0][k], tensors[-2][k]) for k in tensors[0])


def test_existing_folder_is_refused_without_overwrite(bert, tmp_path):
    model, _, batches = bert
    cal = calibrate(model, batches, preset("w8a8-dynamic"), progress=False)
    target = tmp_path / "ct"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    # not quantscope's: refused as such, with no overwrite=True offered that would be refused
    with pytest.raises(ValueError, match="is not a folder quantscope wrote") as e:
        quantscope.export(cal, model, target)
    assert "overwrite=True" not in str(e.value)
    assert os.listdir(target) == ["keep.txt"]
    # overwrite replaces only what quantscope wrote (issue 37): a user's folder stays
    with pytest.raises(ValueError, match="is not a folder quantscope wrote"):
        quantscope.export(cal, model, target, overwrite=True)
    assert os.listdir(target) == ["keep.txt"]
    (target / "keep.txt").unlink()
    quantscope.export(cal, model, target)  # an empty folder holds nothing to lose
    # a file added to an earlier export is not quantscope's to delete: refused, named
    (target / "stale.txt").write_text("added after the export")
    with pytest.raises(ValueError, match=r"did not write there \(stale\.txt\)"):
        quantscope.export(cal, model, target, overwrite=True)
    assert "stale.txt" in os.listdir(target)
    (target / "stale.txt").unlink()
    quantscope.export(cal, model, target, overwrite=True)
    assert "config.json" in os.listdir(target)
    assert sorted(os.listdir(tmp_path)) == ["ct"]  # no temporary folder left


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anyway")
def test_read_only_target_is_refused(bert, tmp_path):
    model, _, batches = bert
    cal = calibrate(model, batches, preset("w8a8-dynamic"), progress=False)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            quantscope.export(cal, model, ro / "ct")
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


def test_target_under_a_file_is_refused(bert, tmp_path):
    model, _, batches = bert
    cal = calibrate(model, batches, preset("w8a8-dynamic"), progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        quantscope.export(cal, model, tmp_path / "file" / "ct")
    assert os.listdir(tmp_path) == ["file"]


def test_failure_while_writing_leaves_nothing(bert, tmp_path, monkeypatch):
    from compressed_tensors.compressors import ModelCompressor

    model, _, batches = bert
    cal = calibrate(model, batches, preset("w8a8"), progress=False)

    def broken(self, directory):
        raise OSError("disk full")

    monkeypatch.setattr(ModelCompressor, "update_config", broken)
    with pytest.raises(OSError, match="disk full"):
        quantscope.export(cal, model, tmp_path / "ct")
    assert os.listdir(tmp_path) == []


def test_export_leaves_the_model_untouched(bert, tmp_path):
    model, _, batches = bert
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cal = calibrate(model, batches, preset("w4a16"), progress=False)
    quantscope.export(cal, model, tmp_path / "ct")
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not hasattr(model.get_submodule("pooler.dense"), "quantization_scheme")


def test_cli_export_of_a_calibrate_run(bert, tmp_path):
    from quantscope import cli

    model, src, batches = bert
    cal = calibrate(model, batches, preset("w8a8"), progress=False)
    cal.info["model"] = src  # what `quantscope calibrate` records
    save_calibration(cal, tmp_path / "run" / "qparams")
    assert cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "ct")]) == 0
    assert os.path.isfile(tmp_path / "ct" / "tokenizer.json")
    assert cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "ct")]) == 2  # refused: exists
    back = Calibration.from_compressed_tensors(tmp_path / "ct")
    assert back.info["model"] == src  # the float model the exporter recorded
    assert torch.equal(_applied(back, model, batches[0]), _applied(cal, model, batches[0]))


def test_reader_refuses_a_plain_model_folder(bert):
    _, src, _ = bert
    with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
        Calibration.from_compressed_tensors(src)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a GPU")
def test_vllm_serves_the_export_like_transformers(llama, tmp_path):
    vllm = pytest.importorskip("vllm")
    model, src, batches = llama
    cal = calibrate(model, batches, preset("w8a8", ignore=("lm_head",)), progress=False)
    out = quantscope.export(cal, model, tmp_path / "ct", model_path=src)
    _tokenizer().save_pretrained(out)
    prompt = batches[0]["input_ids"][0].tolist()
    with torch.inference_mode():
        hf = _loaded(out, transformers.AutoModelForCausalLM).generate(
            torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):].tolist()
    llm = vllm.LLM(out, enforce_eager=True, dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = llm.generate({"prompt_token_ids": prompt},
                           vllm.SamplingParams(max_tokens=4, temperature=0))
    assert got[0].outputs[0].token_ids[:2] == hf[:2]


@pytest.mark.parametrize("tile", [(48, 32), (32, 48), (256, 256)])
def test_fp8_tiles_with_a_partial_last_tile_load_in_transformers(llama, tmp_path, tile):
    """Probe: a partial last column tile was refused as 'no compressed-tensors equivalent';
    compressed-tensors pads partial tiles both ways (llm-compressor writes block-128 on a
    64-wide model): one e4m3 scale per tile, ceil'd, and transformers runs it as apply()."""
    model, _, batches = llama
    spec = QuantSpec("fp8_e4m3", f"tile:{tile[0]}x{tile[1]}")
    cal = calibrate(model, batches, _recipe(Role(spec, "memoryless_minmax"), ignore=["lm_head"]),
                    progress=False)
    out = cal.export(model, tmp_path / "ct")
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")  # [128, 256]
    assert scale.shape == (-(-128 // tile[0]), -(-256 // tile[1]))
    with torch.inference_mode():
        got = _out(_loaded(out, transformers.AutoModelForCausalLM), batches[0])
    _compare(got, _applied(cal, model, batches[0]), True)


@pytest.mark.parametrize(("options", "error", "said"), [
    ({"max_shard_size": "lots"}, ValueError, "max_shard_size must be a size of at least one"),
    ({"max_shard_size": "0.0001KB"}, ValueError, "got '0.0001KB'"),  # (0 bytes to the hub)
    ({"max_shard_size": -5}, ValueError, "got -5"),  # (one shard per tensor, written)
    ({"max_shard_size": "0GB"}, ValueError, "got '0GB'"),
    ({"max_shard_size": True}, ValueError, "got True"),
    ({"max_shard_size": 0.5}, ValueError, "got 0.5"),  # (s57 mutants: below one byte)
    ({"max_shard_size": "infGB"}, ValueError, "got 'infGB'"),  # (not a bare OverflowError)
    ({"max_shard_size": "nanGB"}, ValueError, "got 'nanGB'"),
    ({"model_path": 5}, TypeError, "model_path must be the source model's folder"),
])
def test_shard_size_and_model_path_are_checked_with_the_other_arguments(bert, tmp_path,
                                                                        options, error, said):
    # the registry runs these checks on every rank; these two were the writer's alone (rank
    # 0 raised transformers' "Unit 'TS' not supported", the others returned the path)
    from quantscope.exporters.compressed_tensors import _check_call

    model, _, batches = bert
    cal = calibrate(model, batches, preset("w8a8"), progress=False)
    args = {"overwrite": False, "allow_lossy": False, "model_path": None,
            "max_shard_size": "5GB", **options}
    with pytest.raises(error, match=f"^export compressed-tensors: .*{re.escape(said)}"):
        _check_call(cal, model, **args)
    with pytest.raises(error):
        quantscope.export(cal, model, tmp_path / "ct", **options)
    assert not list(tmp_path.iterdir())
    for size in (100, "5GB", " 0.5 gb ", "1TB", 5e9, np.int64(8000)):  # what the hub takes
        _check_call(cal, model, **{**args, "model_path": None, "max_shard_size": size})
