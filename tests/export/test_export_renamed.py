"""compressed-tensors export of a model whose checkpoint names differ from its module names
(Llava: ``language_model.*`` on disk, ``model.language_model.*`` in memory): the config's
``ignore`` matches the tensors on disk, renamed once, whether the model came from
``from_pretrained`` (compressed-tensors renames the list itself then) or was built in memory,
and the model's own names beside them, as vLLM reads the checkpoint's names (through its
prefix map, which passes ``re:`` patterns over) and transformers' compressed-tensors loader
the model's (GPT-NeoX's ``embed_out`` is its ``lm_head``: ignored under the disk name alone,
transformers loaded it quantized with uninitialised scales)."""

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

import quantscope
from quantscope.calibration import Calibration, calibrate, preset

IGNORE = ("re:.*vision_tower.*", "re:.*multi_modal_projector.*", "lm_head",
          "model.language_model.layers.0.mlp.down_proj")
#: the ignored layers' names on disk, and in the model
ON_DISK = {"language_model.model.layers.0.mlp.down_proj":
           "model.language_model.layers.0.mlp.down_proj", "language_model.lm_head": "lm_head"}


def _config():
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=128, max_position_embeddings=64)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=32, patch_size=16)
    return transformers.LlavaConfig(text_config=text, vision_config=vision,
                                    image_token_index=127)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llava") / "src"
    transformers.LlavaForConditionalGeneration(_config()).save_pretrained(path)
    return path


def _export(model, source, out):
    batches = [{"input_ids": torch.randint(0, 120, (2, 12), generator=torch.Generator()
                                           .manual_seed(1))}]
    calib = calibrate(model.eval(), batches, preset("fp8-dynamic", ignore=IGNORE),
                      progress=False)
    quantscope.export(calib, model, out, model_path=source)
    with open(out / "config.json") as f:
        ignore = json.load(f)["quantization_config"]["ignore"]
    layers = {k.rpartition(".")[0] for k in safetensors.load_file(out / "model.safetensors")}
    return ignore, layers


@pytest.mark.parametrize("how", ["from_pretrained", "in_memory"])
def test_ignore_names_the_tensors_on_disk(source, tmp_path, how):
    cls = transformers.LlavaForConditionalGeneration
    model = cls.from_pretrained(source) if how == "from_pretrained" else cls(_config())
    ignore, layers = _export(model, source, tmp_path / "out")
    for name, module in ON_DISK.items():  # the disk's name and the model's, plain
        assert name in ignore and module in ignore, (name, ignore)
    assert set(ON_DISK) <= layers  # (those the tensors on disk have)
    read = Calibration.from_compressed_tensors(tmp_path / "out")
    assert "model.language_model.layers.0.mlp.down_proj" not in read.states
    assert "model.language_model.layers.0.mlp.up_proj" in read.states


def test_a_float_layer_the_ignore_misses_is_named(source, tmp_path):
    model = transformers.LlavaForConditionalGeneration.from_pretrained(source)
    _export(model, source, tmp_path / "out")
    cfg_path = tmp_path / "out" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    ignore = cfg["quantization_config"]["ignore"]
    ignore[:] = [n for n in ignore if not n.endswith("layers.0.mlp.down_proj")]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj: .*no weight_scale is "
                                         r"stored .*ignore does not name"):
        Calibration.from_compressed_tensors(tmp_path / "out")


@pytest.mark.parametrize("preset_name", ["w8a8", "fp8"])
def test_a_renamed_layer_left_in_float_loads_in_float_in_transformers(tmp_path, preset_name):
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=100,
                                     max_position_embeddings=64)
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    batch = {"input_ids": torch.randint(0, 100, (2, 8), generator=torch.Generator()
                                        .manual_seed(1))}
    calib = calibrate(model, [batch], preset(preset_name, ignore=["lm_head"]), progress=False)
    quantscope.export(calib, model, tmp_path / "out")
    with torch.inference_mode(), calib.apply(model):
        want = model(**batch).logits
    loaded, info = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "out",
                                                                  output_loading_info=True)
    assert not info["missing_keys"]  # (lm_head's scales were, filled at random)
    with torch.inference_mode():
        assert torch.equal(loaded.eval()(**batch).logits, want)


def test_a_renamed_layer_with_an_ambiguous_name_is_written_as_both_regexes():
    # s57 mutants: a model name that reads as a class name (or a "re:" pattern) is written as
    # regexes; both names, or transformers' loader (the model's name) misses the layer
    from quantscope.exporters.ct_compress import _written

    assert _written("Embedding", "embed_out", True) == ["re:embed_out$", "re:Embedding$"]
    assert _written("Embedding", "Embedding", True) == ["re:Embedding$"]
    assert _written("lm_head", "embed_out", False) == ["embed_out", "lm_head"]
