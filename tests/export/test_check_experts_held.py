"""`quantscope check` flags an experts module whose experts do not all hold the input scale
vLLM's fused MoE layer holds once per module (w13, w2): their schemes differ (static on some,
dynamic or float on others) and the layer runs one (found by probing: only the values of
the experts that held a scale were compared, so such a checkpoint passed)."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

import quantscope
from quantscope.cli import main
from quantscope.exporters import check
from quantscope.exporters.consistency import format_problems

EXPERTS = "model.layers.0.mlp.experts"


def _fp8_experts(drop=(), leaf="input_scale"):
    """A hand-written FP8 experts module of 4 experts, one input scale per slot; the down
    inputs of the experts ``drop`` hold none (dynamic)."""
    t = {}
    for e in range(4):
        for p in ("gate_proj", "up_proj", "down_proj"):
            name = f"{EXPERTS}.{e}.{p}"
            t[f"{name}.weight"] = torch.zeros(4, 4).to(torch.float8_e4m3fn)
            t[f"{name}.weight_scale"] = torch.tensor([0.5])
            if not (p == "down_proj" and e in drop):
                t[f"{name}.{leaf}"] = torch.tensor([0.25 if p == "down_proj" else 0.125])
    return t


def _write(folder, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {}}}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_all_or_no_experts_holding_the_input_scale_pass(tmp_path):
    assert check(_write(tmp_path / "all", _fp8_experts())) == []
    assert check(_write(tmp_path / "none", _fp8_experts(drop=range(4)))) == []


@pytest.mark.parametrize("leaf", ["input_scale", "input_global_scale"])
def test_experts_holding_the_input_scale_in_part_are_flagged(tmp_path, capsys, leaf):
    d = _write(tmp_path / "split", _fp8_experts(drop=(1, 3), leaf=leaf))
    problems = check(d)
    assert [(p["group"], p["experts"], p["tensor"], p["held_by"]) for p in problems] == [
        (EXPERTS, "down_proj", leaf, [f"{EXPERTS}.0.down_proj", f"{EXPERTS}.2.down_proj"])]
    assert problems[0]["layers"] == [f"{EXPERTS}.{e}.down_proj" for e in range(4)]
    text = format_problems(problems)
    assert (f"{EXPERTS}: {leaf} of the experts' down_proj inputs is held by 0.down_proj, "
            f"2.down_proj but not by 1.down_proj, 3.down_proj") in text
    assert "fused MoE layer runs one scheme" in text
    assert main(["check", str(d)]) == 1
    assert "but not by 1.down_proj, 3.down_proj" in capsys.readouterr().out


def test_export_of_a_split_experts_module_is_flagged(tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import qwen3_moe

    model, batches = qwen3_moe(layers=1, n_batches=2)
    calib = quantscope.calibrate(model, batches, "fp8", progress=False)
    # what keep_float made before it took experts modules out whole: expert 2's gate / up
    # input float, the others' static
    states = {layer: dict(roles) for layer, roles in calib.states.items()}
    del states[f"{EXPERTS}.2.gate_up_proj"]["input"]
    calib = replace(calib, states=states)
    out = tmp_path / "ct"
    calib.export(model, out)
    problems = [p for p in check(out) if p.get("experts")]
    assert [(p["group"], p["experts"], p["tensor"]) for p in problems] == [
        (EXPERTS, "w13", "input_scale")]
    assert sorted(set(problems[0]["layers"]) - set(problems[0]["held_by"])) == [
        f"{EXPERTS}.2.gate_proj", f"{EXPERTS}.2.up_proj"]
