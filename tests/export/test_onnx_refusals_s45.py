"""ONNX export refusals of probe s45, one rule for the Python API and the command line: a
calibration of a model's 3-D MoE experts was blamed on "a calibration of another model?",
and a KV-cache calibration was told to "quantize the Linears inside a block" (Python) or that
only weight and input roles export (CLI); each now says what the ONNX export lacks and what
to do instead."""

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("transformers")

import tiny_models
from cli_helpers import run_cli

import quantscope
from quantscope.calibration import Recipe, calibrate, preset

torch.set_num_threads(1)


def _both_refuse(capsys, tmp_path, model, cal, example, words):
    """The Python export and ``quantscope export --format onnx`` of ``cal`` (saved as a run,
    ``model`` as its folder) refuse it with a message holding every one of ``words``."""
    with pytest.raises(ValueError) as e:
        quantscope.export(cal, model, tmp_path / "m.onnx", format="onnx",
                          example_inputs=example)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tiny_models.tokenizer(pad=False).save_pretrained(folder)
    cal.save(tmp_path / "run")
    rc, _, err = run_cli(capsys, "export", str(tmp_path / "run"), "--format", "onnx",
                         "--model", str(folder), "--out", str(tmp_path / "cli.onnx"))
    assert rc != 0
    for message in (str(e.value), err):
        assert all(w in message for w in words), message
        assert "another model" not in message and "inside a block" not in message, message
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "cli.onnx").exists()


def test_3d_moe_experts_are_refused_as_such(tmp_path, capsys):
    model, batches = tiny_models.qwen3_moe(layers=1, n_batches=2)
    cal = calibrate(model, batches, preset("w8a8", ignore=["lm_head", "re:.*mlp.gate$"]),
                    progress=False)
    assert "model.layers.0.mlp.experts.0.gate_up_proj" in cal.states  # the case
    _both_refuse(capsys, tmp_path, model, cal, (torch.cat(batches),),
                 ["3-D MoE experts", "does not write MoE experts", "compressed-tensors",
                  "keep the experts in float", "ignore 're:.*experts'"])


@pytest.mark.parametrize("recipe", ["kv only", "w8a8 with kv"])
def test_a_kv_cache_calibration_is_refused_as_such(recipe, tmp_path, capsys):
    model, batches = tiny_models.llama()
    rec = Recipe((), kv_cache="fp8") if recipe == "kv only" else \
        preset("w8a8", kv_cache="fp8", ignore=["lm_head"])
    cal = calibrate(model, batches, rec, progress=False)
    _both_refuse(capsys, tmp_path, model, cal, (torch.cat(batches[:2]),),
                 ["model.layers.0.self_attn key", "KV cache", "no KV cache",
                  "calibrate without kv_cache", "compressed-tensors"])
