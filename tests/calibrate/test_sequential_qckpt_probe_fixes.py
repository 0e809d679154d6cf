"""Probe (s15/safety/repro_sequential_quantized_checkpoint.py): sequential calibration from a
quantized compressed-tensors checkpoint (quantscope's own w8a8 / fp8 export) read the int8 /
fp8 codes as float weights (q_proj scales ~1.0 instead of ~4e-4), with only an "unused
tensors" warning. transformers decompresses such a checkpoint; quantscope's reader does not,
so it refuses it, naming the checkpoint and what to calibrate from instead."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantscope import export
from quantscope.calibration import Sequential, calibrate, empty_model
from quantscope.calibration.run.checkpoint import Checkpoint, load_params

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval()


_BATCHES = [{"input_ids": torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))}]


@pytest.mark.parametrize("recipe", ["w8a8", "fp8"])
def test_a_quantized_checkpoint_is_refused(tmp_path, recipe):
    model = _model()
    ckpt = tmp_path / f"llama-{recipe}"
    export(calibrate(model, _BATCHES, recipe, progress=False), model, ckpt)
    with pytest.raises(ValueError, match=r"checkpoint '.*llama-.*' is quantized .*"
                                         r"quantization_config.*compressed-tensors.*"
                                         r"calibrate from the float \(unquantized\) checkpoint"):
        calibrate(empty_model(ckpt), _BATCHES, recipe, sequential=Sequential(checkpoint=ckpt),
                  progress=False)
    with pytest.raises(ValueError, match="is quantized"):  # the skeleton from a float folder
        Checkpoint(ckpt)


def test_quantized_codes_without_a_config_are_refused(tmp_path):
    """The weights file alone (no config.json beside it): int8 codes into a float
    parameter are refused by their dtype, the model left as it was."""
    model = _model()
    ckpt = tmp_path / "llama-w8a8"
    export(calibrate(model, _BATCHES, "w8a8", progress=False), model, ckpt)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ckpt / "model.safetensors", alone / "model.safetensors")
    skeleton = empty_model(_float_folder(tmp_path / "float", model))
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=rf"tensor '{q}' holds torch.int8 .*calibrate from "
                                         r"the float"):
        load_params(skeleton, {q}, Checkpoint(alone), "cpu")
    assert skeleton.get_submodule(q.rpartition(".")[0]).weight.device.type == "meta"


def _float_folder(path, model):
    model.save_pretrained(path)
    return path


def test_the_float_checkpoint_still_calibrates_as_the_whole_model(tmp_path):
    model = _model()
    ckpt = _float_folder(tmp_path / "llama", model)
    whole = calibrate(model, _BATCHES, "w8a8", progress=False)
    seq = calibrate(empty_model(ckpt), _BATCHES, "w8a8", sequential=Sequential(checkpoint=ckpt),
                    progress=False)
    q = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(seq.states[q]["weight"].qparams.scale,
                               whole.states[q]["weight"].qparams.scale)
    # a float16 checkpoint is float, not codes
    half = tmp_path / "half"
    shutil.copytree(ckpt, half)
    tensors = {k: v.half() for k, v in load_file(half / "model.safetensors").items()}
    save_file(tensors, half / "model.safetensors", metadata={"format": "pt"})
    calibrate(empty_model(half), _BATCHES, "w8a8", sequential=Sequential(checkpoint=half),
              progress=False)
