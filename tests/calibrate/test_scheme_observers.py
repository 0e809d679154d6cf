"""compressed-tensors' FP8 and NVFP4 schemes calibrate their input activations with
``static_minmax`` (the running max over every batch), and llm-compressor's oneshot runs it:
``scheme()`` keeps each role's own observer, and the ``nvfp4`` preset its inputs', unless an
observer is given."""

import pytest
import torch
from torch import nn

import quantscope
from quantscope.calibration.recipe import preset, scheme
from quantscope.formats import FP8_E4M3
from quantscope.scales import nvfp4_global_scale

pytest.importorskip("compressed_tensors")

FP4_MAX = 6.0


def _batches():
    g = torch.Generator().manual_seed(0)
    first = torch.randn(4, 32, generator=g)
    return [first, 4 * torch.randn(4, 32, generator=g)]  # the second: 4x the range


def _input_state(recipe):
    model = nn.Sequential(nn.Linear(32, 16, bias=False))
    return quantscope.calibrate(model, _batches(), recipe, progress=False).states["0"]["input"]


def _amax():
    return max(b.abs().max() for b in _batches())  # static_minmax's range: all batches


def test_fp8_scheme_inputs_take_the_running_max_of_all_batches():
    rule = scheme("FP8").rules[0]
    assert (rule.weight.observer, rule.input.observer) == ("memoryless_minmax", "static_minmax")
    st = _input_state(scheme("FP8"))
    assert torch.equal(st.qparams.scale.reshape(()), (_amax() / FP8_E4M3.max).reshape(()))


@pytest.mark.parametrize("recipe", [lambda: scheme("NVFP4"), lambda: preset("nvfp4"),
                                    lambda: "nvfp4"], ids=["scheme", "preset", "name"])
def test_nvfp4_inputs_take_the_running_max_of_all_batches(recipe):
    """Also by name (``calibrate(model, batches, "nvfp4")``: it ran minmax)."""
    rule = preset(recipe()).rules[0]
    assert (rule.weight.observer, rule.input.observer) == ("memoryless_minmax", "static_minmax")
    assert rule.input.dynamic == "local"
    st = _input_state(recipe())
    assert st.observer == "static_minmax"
    assert st.global_amax.item() == _amax().item()
    # the global scale llm-compressor writes: fp8 max * fp4 max / amax of every batch
    want = torch.tensor(FP8_E4M3.max * FP4_MAX) / _amax()
    assert torch.equal(nvfp4_global_scale(st.global_amax, st.spec.format), want)


@pytest.mark.parametrize("make", [lambda o: preset("nvfp4", o), lambda o: scheme("FP8", o),
                                  lambda o: scheme("NVFP4", o)])
def test_an_observer_given_runs_on_every_calibrated_role(make):
    rule = make("minmax").rules[0]
    assert (rule.weight.observer, rule.input.observer) == ("memoryless_minmax", "minmax")
    assert make("mse").rules[0].input.observer == "mse"


def test_minmax_given_to_the_fp8_scheme_is_the_moving_average():
    first, second = _batches()
    lo, hi = (first.min() + 0.01 * (second.min() - first.min()),  # averaging constant 0.01
              first.max() + 0.01 * (second.max() - first.max()))
    st = _input_state(scheme("FP8", "minmax"))
    assert torch.allclose(st.qparams.scale.reshape(()), torch.maximum(-lo, hi) / FP8_E4M3.max)


def test_other_presets_and_schemes_naming_no_observer_keep_minmax():
    for recipe in (preset("fp8"), preset("w8a8"), scheme("W4A8", targets="Linear")):
        rule = recipe.rules[0]
        assert rule.weight.observer == "memoryless_minmax"
        assert rule.input.observer == ("minmax" if rule.input.dynamic is not True
                                       else "memoryless_minmax")


def test_options_without_an_observer_go_to_the_schemes_own():
    rule = scheme("FP8", non_finite="ignore").rules[0]
    assert rule.input.observer == "static_minmax"
    assert dict(rule.input.options) == {"non_finite": "ignore"}
    assert dict(preset("nvfp4", non_finite="ignore").rules[0].input.options) == {
        "non_finite": "ignore"}


def test_a_scheme_observer_quantscope_does_not_register_is_named(monkeypatch):
    from compressed_tensors.quantization import quant_scheme

    args = quant_scheme.PRESET_SCHEMES["FP8"]["input_activations"]
    monkeypatch.setitem(quant_scheme.PRESET_SCHEMES["FP8"], "input_activations",
                        args.model_copy(update={"observer": "no_such_observer"}))
    with pytest.raises(ValueError, match="scheme 'FP8': its input observer 'no_such_observer' "
                                         "is not one quantscope registers; pass observer="):
        scheme("FP8")
    assert scheme("FP8", "minmax").rules[0].input.observer == "minmax"


def _llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)).save_pretrained(path)
    return LlamaForCausalLM


def _tokenizer():
    """A 100-word tokenizer: oneshot wants a processor whenever a dataset is given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


@pytest.mark.peers
@pytest.mark.parametrize("name", ["FP8", "NVFP4"])
def test_scheme_input_scales_are_llmcompressor_oneshots(name, tmp_path):
    pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    cls = _llama(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, 100, (1, 12), generator=g) for _ in range(4)]
    theirs = cls.from_pretrained(tmp_path)
    oneshot(model=theirs, dataset=Dataset.from_dict({
        "input_ids": [i[0].tolist() for i in ids], "attention_mask": [[1] * 12 for _ in ids]}),
        recipe=QuantizationModifier(targets="Linear", scheme=name, ignore=["lm_head"]),
        num_calibration_samples=4, max_seq_length=12, pipeline="basic", processor=_tokenizer())
    ours = quantscope.calibrate(cls.from_pretrained(tmp_path).eval(),
                                [{"input_ids": i, "attention_mask": torch.ones_like(i)}
                                 for i in ids], scheme(name, ignore=["lm_head"]), progress=False)
    for layer, roles in ours.states.items():
        st, module = roles["input"], theirs.get_submodule(layer)
        if name == "FP8":
            got, want = st.qparams.scale.reshape(()), module.input_scale.reshape(())
        else:
            got = nvfp4_global_scale(st.global_amax, st.spec.format).reshape(())
            want = module.input_global_scale.reshape(())
        # within float rounding (the forwards differ by an ulp); minmax is off by up to 3x
        assert torch.allclose(got, want.float(), rtol=1e-5), layer
