"""The KV cache: keys after the rotary embedding and values, calibrated, applied, exported."""

import json

import pytest
import torch

from quantscope import fake_quantize
from quantscope.calibration import (
    Calibration,
    Recipe,
    Role,
    calibrate,
    calibrate_many,
    load,
    preset,
)
from quantscope.calibration.recipe import KV_CACHE
from quantscope.qparams import qparams_from_range

transformers = pytest.importorskip("transformers")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def tiny_llama(attn="sdpa", seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=100, attn_implementation=attn)
    model = transformers.LlamaForCausalLM(cfg).eval()
    batches = [torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    return model, batches


class Cache:
    """The reference: keys as ``apply_rotary_pos_emb`` returns them and ``v_proj``'s outputs,
    recorded per layer (and, given ``qdq``, replaced by their fake-quantized values)."""

    def __init__(self, model, monkeypatch, qdq=None):
        self.keys, self.values, self.qdq = {}, {}, qdq or {}
        self.layer = None
        rotary = llama.apply_rotary_pos_emb
        attn = {id(layer.self_attn): f"model.layers.{i}.self_attn"
                for i, layer in enumerate(model.model.layers)}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            def pre(mod, args, kw):
                self.layer = attn[id(mod)]
            self.handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(layer.self_attn.v_proj.register_forward_hook(
                lambda mod, a, out, name=f"model.layers.{i}.self_attn": self._record(
                    self.values, name, "value", out)))

        def rotate(q, k, cos, sin, *a, **kw):
            q, k = rotary(q, k, cos, sin, *a, **kw)
            return q, self._record(self.keys, self.layer, "key", k)
        self.patch = monkeypatch
        monkeypatch.setattr(llama, "apply_rotary_pos_emb", rotate)

    def _record(self, store, name, role, x):
        store.setdefault(name, []).append(x.detach().clone())
        return fake_quantize(x, *self.qdq[name][role]) if name in self.qdq else x

    def remove(self):
        for h in self.handles:
            h.remove()
        self.patch.undo()


def amax_scale(xs):
    x = torch.cat([t.reshape(-1) for t in xs])
    return qparams_from_range(x.min().reshape(1), x.max().reshape(1), KV_CACHE["fp8"])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_kv_scales_are_the_cached_keys_and_values(attn, monkeypatch):
    model, batches = tiny_llama(attn)
    ref = Cache(model, monkeypatch)
    with torch.inference_mode():
        for b in batches:
            model(b)
    ref.remove()
    kv = Role(KV_CACHE["fp8"], "static_minmax")  # the range of every value seen
    calib = calibrate(model, batches, preset("w8a8", kv_cache=kv), progress=False)
    assert model.config._attn_implementation == attn  # restored after calibration
    for name in ref.keys:
        states = calib.states[name]
        assert set(states) == {"key", "value"}
        # keys after the rotary embedding: not k_proj's output
        assert torch.equal(states["key"].qparams.scale, amax_scale(ref.keys[name]).scale)
        assert torch.equal(states["value"].qparams.scale, amax_scale(ref.values[name]).scale)


def test_apply_fake_quantizes_the_cache_as_its_scales_say(monkeypatch):
    model, batches = tiny_llama()
    calib = calibrate(model, batches, preset("w8a8", kv_cache="fp8"), progress=False)
    kv = {n: r for n, r in calib.states.items() if "key" in r}
    rest = {n: r for n, r in calib.states.items() if "key" not in r}
    x = batches[0]
    with calib.apply(model), torch.inference_mode():
        got = model(x).logits
    assert model.config._attn_implementation == "sdpa"
    spec = KV_CACHE["fp8"]
    ref = Cache(model, monkeypatch, {n: {r: (st.qparams, spec) for r, st in roles.items()}
                                     for n, roles in kv.items()})
    with Calibration(calib.recipe, rest, "no kv").apply(model), torch.inference_mode():
        want = model(x).logits
    ref.remove()
    assert torch.equal(got, want)
    with Calibration(calib.recipe, rest, "no kv").apply(model), torch.inference_mode():
        assert not torch.equal(model(x).logits, got)  # the cache quantization did something


def test_an_attention_implementation_chosen_while_applied_is_routed_too(monkeypatch):
    """transformers' set_attn_implementation while applied dropped the cache's QDQ without a
    word (the config no longer named the routed function), and remove() then put back the
    implementation of apply time over the user's choice."""
    model, batches = tiny_llama("sdpa")
    calib = calibrate(model, batches, preset("w8a8", kv_cache="fp8"), progress=False)
    x = batches[0]
    with torch.inference_mode():
        with calib.apply(model):
            model.set_attn_implementation("eager")
            got = model(x).logits
        assert model.config._attn_implementation == "eager"  # the user's choice kept
        with calib.apply(model):  # applied on eager from the start: the reference
            want = model(x).logits
        floats = model(x).logits
    assert torch.equal(got, want) and not torch.equal(got, floats)


def test_any_observer_and_round_trips(tmp_path):
    model, batches = tiny_llama()
    recipe = preset("w8a8", "mse", kv_cache="fp8")
    assert recipe.kv_cache.observer == "mse"
    assert preset("w8a8", "auto", kv_cache="fp8").kv_cache.observer == "minmax"
    assert recipe.with_observer("auto").kv_cache == recipe.kv_cache  # auto: KV left as it is
    assert recipe.with_observer("percentile").kv_cache.observer == "percentile"
    calib = calibrate(model, batches, recipe, progress=False)
    assert calib.states["model.layers.0.self_attn"]["key"].observer == "mse"
    calib.save(tmp_path / "run")
    back = load(tmp_path / "run")
    assert back.recipe.kv_cache == recipe.kv_cache
    for role in ("key", "value"):
        assert torch.equal(back.states["model.layers.1.self_attn"][role].qparams.scale,
                           calib.states["model.layers.1.self_attn"][role].qparams.scale)


def test_fp8_kv_preset_and_bad_options():
    assert preset("fp8-kv").kv_cache == Role(KV_CACHE["fp8"], "minmax")
    assert preset("fp8").kv_cache is None
    with pytest.raises(ValueError, match="kv_cache must be None, a Role or one of"):
        preset("w8a8", kv_cache="int3")
    with pytest.raises(ValueError, match="static per-tensor scales"):
        preset("w8a8", kv_cache=Role(KV_CACHE["fp8"], "minmax", dynamic=True))
    recipe = preset("w8a8", kv_cache="fp8")
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    with pytest.raises(ValueError, match="no attention module with k_proj, v_proj or qkv_proj"):
        calibrate(torch.nn.Sequential(torch.nn.Linear(4, 4)), [torch.randn(2, 4)], recipe,
                  progress=False)


def test_sequential_calibrates_the_kv_cache_as_the_whole_pass(tmp_path):
    from quantscope.calibration import empty_model

    model, batches = tiny_llama()
    model.save_pretrained(tmp_path / "ckpt")
    recipe = preset("w8a8", "static_minmax", kv_cache="fp8")
    whole = calibrate(model, batches, recipe, progress=False)
    seq = calibrate(empty_model(tmp_path / "ckpt"), batches, recipe, progress=False,
                    sequential=True, checkpoint=tmp_path / "ckpt")
    for i in range(2):
        name = f"model.layers.{i}.self_attn"
        for role in ("key", "value"):
            assert torch.equal(seq.states[name][role].qparams.scale,
                               whole.states[name][role].qparams.scale)


def test_export_writes_vllm_kv_scales(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    model, batches = tiny_llama()
    calib = calibrate(model, batches, preset("w8a8", kv_cache="fp8", ignore="lm_head"),
                      progress=False)
    out = tmp_path / "ct"
    calib.export(model, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(
        {k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
    kv = config.kv_cache_scheme
    assert (kv.type, kv.num_bits, kv.strategy, kv.dynamic, kv.symmetric) == \
        ("float", 8, "tensor", False, True)
    tensors = load_file(out / "model.safetensors")
    for i in range(2):
        name = f"model.layers.{i}.self_attn"
        for role, key in (("key", "k_scale"), ("value", "v_scale")):
            t = tensors[f"{name}.{key}"]
            assert t.dtype == torch.float32 and t.shape == (1,)
            assert torch.equal(t, calib.states[name][role].qparams.scale.reshape(1))
    back = Calibration.from_compressed_tensors(out)
    assert back.recipe.kv_cache.spec == KV_CACHE["fp8"]
    for name, roles in calib.states.items():
        for role, st in roles.items():
            if st.qparams is not None:
                assert torch.equal(back.states[name][role].qparams.scale.reshape(-1),
                                   st.qparams.scale.reshape(-1)), (name, role)


def tiny_gemma3_vlm():
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, head_dim=16, sliding_window=8)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297,
                                    eoi_token_index=298)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    ids = torch.randint(0, 290, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 2:6] = 299
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "pixel_values": pixels, "token_type_ids": (ids == 299).long()}


def test_only_cached_attention_gets_kv_roles():
    """The KV cache holds the decoder's keys and values: a VLM's vision tower (bidirectional,
    never cached) gets no key / value roles, and apply() leaves it as it was."""
    model, batch = tiny_gemma3_vlm()
    calib = calibrate(model, [batch], preset("fp8-kv", ignore=["lm_head"]), progress=False)
    text = {f"model.language_model.layers.{i}.self_attn" for i in range(2)}
    assert {n for n, r in calib.states.items() if "key" in r} == text
    kv = Calibration(calib.recipe, {n: r for n, r in calib.states.items() if "key" in r}, "kv")
    vision = model.model.vision_tower
    with torch.inference_mode():
        ref = vision(pixel_values=batch["pixel_values"]).last_hidden_state
        with kv.apply(model):
            assert torch.equal(vision(pixel_values=batch["pixel_values"]).last_hidden_state, ref)


def test_encoder_attention_is_not_the_kv_cache():
    from quantscope.calibration.structure.kv_cache import attention_modules

    cfg = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=50)
    bart = transformers.BartForConditionalGeneration(cfg)
    # the decoder's self-attention only: not the encoder's, nor the cross-attention
    assert list(attention_modules(bart)) == ["model.decoder.layers.0.self_attn"]
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14)).eval()
    with pytest.raises(ValueError, match="sets kv_cache but the model has no attention module"):
        calibrate(siglip, [{"pixel_values": torch.randn(1, 3, 28, 28)}],
                  preset("fp8-kv"), progress=False)


def test_a_model_without_attention_names_the_first_recipe_asking_for_a_kv_cache():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    recipes = {"a": preset("w8a8"), "b": preset("fp8-kv"),
               "c": preset("w8a8", kv_cache="fp8")}  # named "fp8-kv", then "w8a8"
    with pytest.raises(ValueError, match=r"^calibrate: recipe 'fp8-kv' sets kv_cache but the "
                                         r"model has no attention module"):
        calibrate_many(model, [torch.randn(2, 8)], recipes, progress=False)


def tiny_gemma4_k_eq_v():
    """Gemma 4 whose full-attention layer has no ``v_proj``: its values are ``k_proj``'s output
    (after ``v_norm``), cached as any other layer's."""
    torch.manual_seed(0)
    cfg = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, head_dim=16, global_head_dim=16,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=100, attention_k_eq_v=True,
        num_global_key_value_heads=1, attn_implementation="sdpa")
    return transformers.Gemma4ForCausalLM(cfg).eval()


def tiny_phi3():  # q / k / v fused in one qkv_proj
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Phi3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("build", [tiny_gemma4_k_eq_v, tiny_phi3])
def test_every_cached_layer_gets_the_scales_of_its_cache(build):
    """A cached attention without a ``v_proj`` (Gemma 4's ``attention_k_eq_v``) or with a fused
    ``qkv_proj`` (Phi-3) gets its roles: the scales are the range of what the cache holds."""
    model = build()
    batch = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = model(batch, use_cache=True).past_key_values
    kv = Role(KV_CACHE["fp8"], "static_minmax")
    calib = calibrate(model, [batch], Recipe((), kv_cache=kv), progress=False)
    assert sorted(n for n, r in calib.states.items() if "key" in r) == [
        f"model.layers.{i}.self_attn" for i in range(len(cache.layers))]
    for i, layer in enumerate(cache.layers):
        states = calib.states[f"model.layers.{i}.self_attn"]
        assert torch.equal(states["key"].qparams.scale, amax_scale([layer.keys]).scale)
        assert torch.equal(states["value"].qparams.scale, amax_scale([layer.values]).scale)
