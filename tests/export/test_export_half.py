"""A bf16 / fp16 model's compressed-tensors export holds the codes quantscope's QDQ computes
with the scales it wrote (found by probing: compressed-tensors divided a bf16 weight by a bf16
scale in bf16, so 9 % of the int8 codes were one off ``round(w / s)`` and the checkpoint no
longer ran as ``apply(float_model)``); the scales are still written in the model's dtype."""

import warnings

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

import quantscope
from quantscope.calibration import Calibration, calibrate

torch.set_num_threads(1)


def _model(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    g = torch.Generator().manual_seed(1)
    return model, [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_model_checkpoint_codes_are_quantscopes_qdq(scheme, dtype, tmp_path):
    model, batches = _model(dtype)
    cal = calibrate(model, batches, scheme, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scales rounded to the model's dtype (lossy)
        path = quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
        deployed = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        deployed.hf_quantizer.compressor.decompress_model(deployed)
    back = Calibration.from_compressed_tensors(path)
    stored = safetensors.load_file(f"{path}/model.safetensors")
    differ = 0
    for layer, roles in back.states.items():
        state = roles["weight"]
        assert stored[f"{layer}.weight_scale"].dtype == dtype  # written as before
        w = model.get_submodule(layer).weight.detach()
        qdq = quantscope.fake_quantize(w, state.qparams, state.spec)
        differ += int((qdq != deployed.get_submodule(layer).weight.detach()).sum())
    assert differ == 0


def test_fp16_model_mxfp4_tiny_and_zero_blocks_keep_their_e8m0_scales(tmp_path):
    """An E8M0 scale below float16's range (2**-127 of an all-zero block, ~2**-25 of a tiny
    one) was cast to the float16 parameter compressed-tensors registers: flushed to 0,
    written as code 127 (scale 1.0), the tiny block decompressed to +-6 (found by probing);
    a zero block refused the exact export."""
    from quantscope import presets
    from quantscope.calibration import Recipe, Role, Rule

    model, batches = _model(torch.float16)
    layer = "model.layers.0.self_attn.q_proj"
    w = model.get_submodule(layer).weight
    with torch.no_grad():
        w[0, :32] = 0.0
        w[1, :32] = 2.0 ** -24 * torch.tensor([-1.0, 2.0, 1.0, -3.0] * 8)
    recipe = Recipe(Rule(["Linear"], weight=Role(presets.MXFP4, "memoryless_minmax")),
                    ignore=["lm_head"])
    cal = calibrate(model, batches, recipe, progress=False)
    path = quantscope.export(cal, model, tmp_path / "ct")  # exact: no allow_lossy needed
    stored = safetensors.load_file(f"{path}/model.safetensors")[f"{layer}.weight_scale"]
    assert stored[0, 0] == 0 and stored[1, 0] == 127 - 25  # 2**-127; 3 * 2**-24 -> 2**-25
    deployed = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    deployed.hf_quantizer.compressor.decompress_model(deployed)
    state = cal.states[layer]["weight"]
    qdq = quantscope.fake_quantize(w.detach(), state.qparams, state.spec)
    assert torch.equal(deployed.get_submodule(layer).weight.detach(), qdq)
    back = Calibration.from_compressed_tensors(path).states[layer]["weight"]
    assert torch.equal(back.qparams.scale, state.qparams.scale.float())


@pytest.mark.parametrize("role", ["weight", "input"])
def test_a_scale_the_half_dtype_flushes_to_zero_is_refused_even_when_lossy(role, tmp_path):
    """A spec eps below float16's 2**-24 gave an all-zero row (or input) a scale of 1e-12,
    written as 0 with only a rounding note under allow_lossy (found by probing): a folder
    its own reader refuses."""
    from quantscope.calibration import Recipe, Role, Rule
    from quantscope.layout import Channel, Tensor
    from quantscope.spec import QuantSpec

    model, batches = _model(torch.float16)
    if role == "weight":
        with torch.no_grad():
            model.get_submodule("model.layers.0.mlp.down_proj").weight[0] = 0
        rule = Rule(["Linear"], weight=Role(QuantSpec("int8", Channel(0), eps=1e-12), "minmax"))
    else:
        model.model.layers[0].input_layernorm.weight.data.zero_()  # q/k/v see zeros
        rule = Rule(["Linear"], weight=Role(QuantSpec("int8", Channel(0)), "minmax"),
                    input=Role(QuantSpec("int8", Tensor(), eps=1e-12), "minmax"))
    cal = calibrate(model, batches, Recipe(rule, ignore=["lm_head"]), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"scale holds 9\.99.*e-13, which is 0\.0 in "
                                             r"torch\.float16"):
            quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lossy_note_of_a_pow2_encoding_names_the_dtype_written(dtype, tmp_path):
    import json

    from quantscope.calibration import Recipe, Role, Rule
    from quantscope.layout import Channel
    from quantscope.spec import QuantSpec

    model, batches = _model(dtype)
    spec = QuantSpec("int8", Channel(0), scale="pow2")
    cal = calibrate(model, batches, Recipe(Rule(["Linear"], weight=Role(spec, "minmax")),
                                           ignore=["lm_head"]), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
    notes = json.loads((tmp_path / "ct" / "config.json").read_text())["quantscope"]["lossy"]
    assert notes and all("in the model's dtype" in n and "fp32" not in n for n in notes)
    stored = safetensors.load_file(f"{path}/model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.weight_scale"].dtype == dtype


def test_bf16_kv_cache_scales_are_refused_or_rounded_as_the_other_scales(tmp_path):
    """A bf16 model's k_scale / v_scale were written as float32 values bf16 cannot hold,
    without a word (found by probing): compressed-tensors loads them into bf16 parameters
    (its ``initialize_attn_qparams`` takes the attention's dtype), so the checkpoint ran
    another KV scale than apply(), where a weight or input scale of the model is refused."""
    import json

    from quantscope.calibration import Recipe

    model, batches = _model(torch.bfloat16)
    cal = calibrate(model, batches, Recipe((), kv_cache="fp8"), progress=False)
    scales = {f"{layer}.{key}": cal.states[layer][role].qparams.scale.reshape(1)
              for layer in cal.states for role, key in (("key", "k_scale"), ("value", "v_scale"))}
    rounded = {k: v.to(torch.bfloat16) for k, v in scales.items()}
    assert any(not torch.equal(rounded[k].float(), v) for k, v in scales.items())  # the case
    with pytest.raises(ValueError, match=r"self_attn' (key|value): [kv]_scale not exact in "
                                         r"torch\.bfloat16.*allow_lossy"):
        quantscope.export(cal, model, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
    with pytest.warns(UserWarning, match=r"[kv]_scale not exact in torch\.bfloat16"):
        path = quantscope.export(cal, model, tmp_path / "ct", allow_lossy=True)
    notes = json.loads((tmp_path / "ct" / "config.json").read_text())["quantscope"]["lossy"]
    assert any("k_scale" in n or "v_scale" in n for n in notes)
    stored = safetensors.load_file(f"{path}/model.safetensors")
    for key, value in rounded.items():  # in the model's dtype, as compressed-tensors holds it
        assert stored[key].dtype == torch.bfloat16 and torch.equal(stored[key], value), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kv_cache_scales_are_written_in_a_wide_models_dtype(tmp_path, dtype):
    """compressed-tensors' scale dtype is the attention's own where it is a float one
    (float16, bfloat16, float32, float64; ``initialize_qparams``): a float32 / float64
    model's k_scale / v_scale hold the calibrated values exactly, in its dtype."""
    from quantscope.calibration import Recipe

    model, batches = _model(dtype)
    cal = calibrate(model, batches, Recipe((), kv_cache="fp8"), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing rounded: no lossy note
        path = quantscope.export(cal, model, tmp_path / "ct")
    stored = safetensors.load_file(f"{path}/model.safetensors")
    for layer, roles in cal.states.items():
        for role, key in (("key", "k_scale"), ("value", "v_scale")):
            got = stored[f"{layer}.{key}"]
            assert got.dtype == dtype, (layer, key, got.dtype)
            assert torch.equal(got, roles[role].qparams.scale.reshape(1).to(dtype)), key
