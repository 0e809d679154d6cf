"""Reading back quantscope's own MoE export (issue 37 row 4): the per-expert layers on disk
(Mixtral's ``w1`` / ``w3`` / ``w2``, Qwen2-MoE's ``gate_proj`` / ``up_proj`` / ``down_proj``)
map back onto the model's 3-D experts, equal to the calibration that was exported."""

import json
import warnings

import pytest
import torch

from quantscope.calibration import Calibration, calibrate
from quantscope.calibration.recipe import scheme
from quantscope.scales import nvfp4_global_scale

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tiny_models import mixtral


def _qwen2_moe():
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    return model, [torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(i))
                   for i in range(3)]


MODELS = {"mixtral": mixtral, "qwen2_moe": _qwen2_moe}


def _same_logits(model, batch, calib, back):
    """``back`` applied gives the logits ``calib`` applied gives, bit for bit."""
    with torch.inference_mode():
        with calib.apply(model):
            want = model(batch).logits
        with back.apply(model):
            got = model(batch).logits
    assert torch.equal(got, want)


def _same_state(want, got, spec_format):
    """Equal qparams; a local input's amax may differ by ulps where the global scale it
    gives (what the checkpoint stores and the runtime uses) is the same."""
    if want.quantizes_like(got):
        return True
    if want.dynamic == got.dynamic == "local" and want.spec == got.spec:
        return torch.equal(nvfp4_global_scale(want.global_amax, spec_format),
                           nvfp4_global_scale(got.global_amax, spec_format))
    return False


@pytest.mark.parametrize("preset", ["w8a8", "w4a16-asym", "fp8", "nvfp4"])
@pytest.mark.parametrize("name", list(MODELS))
def test_moe_export_reads_back_as_exported(name, preset, tmp_path):
    model, batches = MODELS[name]()
    calib = calibrate(model, batches, preset, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib.export(model, tmp_path / "ct")
    back = Calibration.from_compressed_tensors(tmp_path / "ct")
    experts = [k for k in calib.states if ".experts." in k]
    assert experts and sorted(back.states) == sorted(calib.states)
    for layer, roles in calib.states.items():
        assert sorted(back.states[layer]) == sorted(roles), layer
        for role, state in roles.items():
            got = back.states[layer][role]
            assert _same_state(state, got, state.spec.format), (layer, role)
            if role == "weight" and state.shape is not None:
                assert tuple(got.shape) == tuple(state.shape), layer
    _same_logits(model, batches[0], calib, back)


def _rewrite(folder, fn):
    from safetensors.torch import load_file, save_file

    (f,) = folder.glob("*.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("recipe, leaf, said", [
    ("fp8", "input_scale", "input"),
    # an NVFP4 weight global scale is never reconciled (vLLM takes w1's)
    ("nvfp4", "weight_global_scale", "per-tensor global scales")])
def test_gate_and_up_that_disagree_are_refused(tmp_path, recipe, leaf, said):
    model, batches = mixtral()
    calib = calibrate(model, batches, recipe, progress=False)
    calib.export(model, tmp_path / "ct")
    key = f"model.layers.0.block_sparse_moe.experts.1.w3.{leaf}"

    def double(tensors):
        tensors[key] = tensors[key] * 2

    _rewrite(tmp_path / "ct", double)
    with pytest.raises(ValueError, match=r"experts model\.layers\.0\.mlp\.experts\.1: gate "
                                         rf"and up hold different {said}"):
        Calibration.from_compressed_tensors(tmp_path / "ct")


def test_an_expert_with_only_gate_quantized_is_refused(tmp_path):
    model, batches = mixtral()
    calib = calibrate(model, batches, "w8a8", progress=False)
    calib.export(model, tmp_path / "ct")
    cfg_file = tmp_path / "ct" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["quantization_config"]["ignore"].append("model.layers.1.block_sparse_moe.experts.2.w3")
    cfg_file.write_text(json.dumps(cfg))
    prefix = "model.layers.1.block_sparse_moe.experts.2.w3."
    _rewrite(tmp_path / "ct", lambda t: [t.pop(k) for k in list(t)
                                         if k.startswith(prefix) and k != prefix + "weight"])
    with pytest.raises(ValueError, match=r"experts model\.layers\.1\.mlp\.experts\.2: only "
                                         r"one of w1 / w3"):
        Calibration.from_compressed_tensors(tmp_path / "ct")


@pytest.mark.parametrize("key", ["num_local_experts", "num_hidden_layers"])
def test_a_config_far_larger_than_its_checkpoint_is_refused(tmp_path, key):
    # make fuzz: num_local_experts 226_112_355_091 built that many expert modules on the
    # meta device until the host ran out of memory
    from quantscope.calibration.run.checkpoint import empty_model

    model, batches = mixtral()
    calibrate(model, batches, "w8a8", progress=False).export(model, tmp_path / "ct")
    cfg_file = tmp_path / "ct" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg[key] = 226_112_355_091 if key == "num_local_experts" else 10**7
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"ct/config\.json: the model it describes has more "
                                         r"than \d+ parameters, where the checkpoint holds"):
        Calibration.from_compressed_tensors(tmp_path / "ct")
    if key == "num_hidden_layers":  # a 3-D experts parameter is one parameter at any size
        with pytest.raises(ValueError, match=r"is quantized"):  # a checkpoint of codes
            empty_model(tmp_path / "ct")
        del cfg["quantization_config"]  # a float checkpoint's config: the size guard
        cfg_file.write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=r"empty_model: .*config\.json: the model"):
            empty_model(tmp_path / "ct")


def test_a_one_output_layer_with_several_packed_zero_points_reads_back(tmp_path):
    # Qwen2-MoE's shared_expert_gate (out_features 1) packs its int4 zero points into one
    # row; compressed-tensors 0.20.1 could not unpack that row once it held several groups
    from quantscope import Group, QuantSpec
    from quantscope.calibration import Recipe, Role, Rule

    model, batches = _qwen2_moe()
    spec = QuantSpec("int4", Group(32), symmetric=False)
    recipe = Recipe((Rule(("Linear",), weight=Role(spec, "minmax")),), ("lm_head",), "w4g32")
    calib = calibrate(model, batches, recipe, progress=False)
    calib.export(model, tmp_path / "ct")
    back = Calibration.from_compressed_tensors(tmp_path / "ct")
    gate = "model.layers.0.mlp.shared_expert_gate"
    assert back.states[gate]["weight"].qparams.zero_point.shape == (1, 4)
    assert back.states[gate]["weight"].quantizes_like(calib.states[gate]["weight"])


# llm-compressor's FP8 checkpoints calibrate an expert's gate and up apart, so their per-tensor
# float8 weight_scales differ; vLLM serves them re-quantized to the larger of the two
# (process_fp8_weight_tensor_strategy_moe), and from_compressed_tensors reads the larger.
# Scales vLLM does not reconcile stay refused (test_gate_and_up_that_disagree_are_refused).
IGNORE = ["lm_head", r"re:.*mlp\.gate$"]
DISK = "model.layers.{}.block_sparse_moe.experts.{}.{}"


def _up_scaled_apart(tensors, factor=3.0):
    """Every expert's w3 re-quantized under its own scale, ``factor`` times w1's: the shape of
    an llm-compressor FP8 checkpoint (gate and up observed apart)."""
    for key in [k for k in tensors if k.endswith(".w3.weight_scale")]:
        codes = key[:-len("_scale")]
        old = tensors[key].float()
        new = old * factor
        tensors[codes] = (tensors[codes].float() * old / new).to(torch.float8_e4m3fn)
        tensors[key] = new.to(tensors[key].dtype)


def _fp8_qdq(w, scale):
    """float8 e4m3 quantize-dequantize of ``w`` with the per-tensor ``scale`` (torch's cast)."""
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def test_fp8_gate_and_up_scales_that_differ_read_as_the_larger(tmp_path):
    model, batches = mixtral()
    calibrate(model, batches, scheme("FP8", ignore=IGNORE), progress=False).export(
        model, tmp_path / "ct")
    tensors = _rewrite(tmp_path / "ct", _up_scaled_apart)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        back = Calibration.from_compressed_tensors(tmp_path / "ct")
    ours = [str(w.message) for w in got if "weight scales" in str(w.message)]
    assert len(ours) == 1, ours  # once for the whole checkpoint
    g0 = float(tensors[DISK.format(0, 0, "w1.weight_scale")])
    u0 = float(tensors[DISK.format(0, 0, "w3.weight_scale")])
    assert "model.layers.0.mlp.experts.0" in ours[0]
    assert repr(g0) in ours[0] and repr(u0) in ours[0]
    ex0 = model.model.layers[0].mlp.experts
    snap = ex0.gate_up_proj.detach().clone()
    with back.apply(model):
        served = ex0.gate_up_proj.detach().clone()
    for i in range(2):
        for e in range(4):
            g = tensors[DISK.format(i, e, "w1.weight_scale")].float().reshape(())
            u = tensors[DISK.format(i, e, "w3.weight_scale")].float().reshape(())
            assert u > g
            st = back.states[f"model.layers.{i}.mlp.experts.{e}.gate_up_proj"]["weight"]
            assert torch.equal(st.qparams.scale.float().reshape(()), torch.maximum(g, u))
    for e in range(4):  # apply(): gate and up rows on the larger scale, as vLLM serves them
        u = tensors[DISK.format(0, e, "w3.weight_scale")].float().reshape(())
        torch.testing.assert_close(served[e], _fp8_qdq(snap[e], u), rtol=0, atol=0)


def test_experts_under_other_names_are_named_in_the_error(tmp_path):
    """llm-compressor 0.14 writes Mixtral's experts as gate_proj / up_proj / down_proj where
    transformers' (and vLLM's) Mixtral names are w1 / w3 / w2: the reader said "KeyError:
    'weight'" of the expected layer; it says that layer has no tensor, and which tensor of the
    folder names no module."""
    model, batches = mixtral()
    calibrate(model, batches, "w8a8", progress=False).export(model, tmp_path / "ct")
    shards = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

    def rename(tensors):
        for key in [k for k in tensors if ".experts." in k]:
            new = key
            for a, b in shards.items():
                new = new.replace(a, b)
            tensors[new] = tensors.pop(key)

    _rewrite(tmp_path / "ct", rename)
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.mlp\.experts\.0\.w1 has no "
                                         r"tensor in the folder; the folder's 'model\.layers\.\d"
                                         r"\.block_sparse_moe\.experts\.\d\.(gate|up|down)_proj"
                                         r"\.\w+' names no module"):
        Calibration.from_compressed_tensors(tmp_path / "ct")


def test_experts_of_one_block_read_back_their_block_scales(tmp_path):
    """An FP8_BLOCK checkpoint (llm-compressor's) whose expert weights are one 128 x 128 block
    each: the gate and up halves' block scales hold one value each, a row of blocks that is
    joined, not a per-tensor scale to reconcile (the read was refused as "different
    per-tensor weight scales"). Made here from an FP8 per-tensor export of weights of one
    block: the same numbers under the block strategy."""
    model, batches = _qwen2_moe()
    calib = calibrate(model, batches, scheme("FP8", ignore=IGNORE), progress=False)
    calib.export(model, tmp_path / "ct")

    def as_blocks(tensors):
        for key in [k for k in tensors if k.endswith(".weight_scale")]:
            tensors[key] = tensors[key].reshape(1, 1)
    _rewrite(tmp_path / "ct", as_blocks)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    (group,) = config["quantization_config"]["config_groups"].values()
    group["weights"].update(strategy="block", block_structure=[128, 128])
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    back = Calibration.from_compressed_tensors(tmp_path / "ct")
    joined = back.states["model.layers.0.mlp.experts.0.gate_up_proj"]["weight"]
    assert joined.qparams.scale.shape == (2, 1)  # gate's block row, then up's
    _same_logits(model, batches[0], calib, back)
