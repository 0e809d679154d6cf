"""MoE experts exported under the checkpoint's per-expert names, as vLLM's loader reads them."""

import json

import pytest
import torch

from quantscope import QuantSpec, presets
from quantscope.calibration import Recipe, Role, Rule, calibrate
from quantscope.calibration.results.apply import qdq_tensor
from quantscope.exporters import check
from quantscope.exporters.experts import checkpoint_names, expert_names
from quantscope.layout import Tensor

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tiny_models import mixtral


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _decompress(folder, tensors, prefix):
    """The float weight compressed-tensors' own compressor rebuilds from ``prefix``'s tensors
    (NVFP4: its fp4 unpacking, then codes x block scale / global scale in float32, since its
    ``decompress`` rounds the result to bfloat16)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(
        {k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
    (scheme,) = config.config_groups.values()
    local = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if config.format == "nvfp4-pack-quantized":
        m, n = local["weight_packed"].shape
        codes = unpack_fp4_from_uint8(local["weight_packed"], m, 2 * n, dtype=torch.float32)
        scale = local["weight_scale"].float() / local["weight_global_scale"].float()
        return (codes.reshape(m, -1, 16) * scale[..., None]).reshape(m, 2 * n)
    compressor = BaseCompressor.get_value_from_registry(config.format)
    return compressor.decompress(local, scheme)["weight"].float()


def test_names_from_transformers_mapping():
    model, _ = mixtral()
    assert expert_names(model) == ("w1", "w3", "w2")
    q = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, num_experts=4, num_experts_per_tok=2))
    assert expert_names(q) == ("gate_proj", "up_proj", "down_proj")
    names = checkpoint_names(model, ["model.layers.0.mlp.experts.1.w1",
                                     "model.layers.0.self_attn.q_proj", "lm_head"])
    assert names == {"model.layers.0.mlp.experts.1.w1":
                     "model.layers.0.block_sparse_moe.experts.1.w1",
                     "model.layers.0.self_attn.q_proj": "model.layers.0.self_attn.q_proj",
                     "lm_head": "lm_head"}


def test_names_without_apply_renamings(monkeypatch):
    """transformers before 5.2x has the renamings but no ``apply_renamings``: the disk names
    must not fall back to the model's own (an export that vLLM's loader could not match)."""
    from transformers import core_model_loading

    monkeypatch.delattr(core_model_loading, "apply_renamings", raising=False)
    model, _ = mixtral()
    assert checkpoint_names(model, ["model.layers.1.mlp.gate"]) == {
        "model.layers.1.mlp.gate": "model.layers.1.block_sparse_moe.gate"}


@pytest.mark.parametrize("preset", ["w8a8", "w4a16", "fp8", "nvfp4"])
def test_experts_written_per_expert(preset, tmp_path):
    model, batches = mixtral()
    calib = calibrate(model, batches, preset, progress=False)
    out = tmp_path / "ct"
    calib.export(model, out)
    tensors = _tensors(out)
    assert not any(".experts.gate_up_proj" in k or ".experts.down_proj" in k for k in tensors)
    # w1 / w3 (vLLM's w13) share their per-tensor scales; vLLM's fused MoE serves no static
    # int8 input, nor fp8 channel weights with one (exporters.serving): said, nothing else
    problems = check(out)
    assert [p for p in problems if p["tensor"] != "config"] == []
    assert bool(problems) == (preset in ("w8a8", "fp8"))
    inter = model.config.intermediate_size
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        for e in range(ex.gate_up_proj.shape[0]):
            disk = f"model.layers.{i}.block_sparse_moe.experts.{e}"
            fused = calib.states[f"model.layers.{i}.mlp.experts.{e}.gate_up_proj"]
            ref = qdq_tensor(ex.gate_up_proj.detach()[e], fused["weight"])
            down = calib.states[f"model.layers.{i}.mlp.experts.{e}.down_proj"]
            shards = {"w1": ref[:inter], "w3": ref[inter:],
                      "w2": qdq_tensor(ex.down_proj.detach()[e], down["weight"])}
            for shard, want in shards.items():
                got = _decompress(out, tensors, f"{disk}.{shard}.")
                assert torch.equal(got, want), (disk, shard)
            if preset in ("w8a8", "fp8"):  # static input scales, gate and up the same
                scale = fused["input"].qparams.scale.reshape(-1)
                for shard in ("w1", "w3"):
                    assert torch.equal(tensors[f"{disk}.{shard}.input_scale"].reshape(-1),
                                       scale)
            if preset == "nvfp4":
                gs = fused["weight"].qparams.global_scale.reshape(-1)
                for shard in ("w1", "w3"):
                    assert torch.equal(
                        tensors[f"{disk}.{shard}.weight_global_scale"].reshape(-1), gs)


def test_experts_without_per_expert_checkpoint_names_refused(tmp_path, monkeypatch):
    from quantscope.exporters import experts

    model, batches = mixtral()
    calib = calibrate(model, batches, "w8a8", progress=False)
    monkeypatch.setattr(experts, "expert_names", lambda m: None)
    with pytest.raises(ValueError, match=r"experts module 'model\.layers\.0\.mlp\.experts'"):
        calib.export(model, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


#: fp8 per-tensor weights with a static per-tensor input: a scheme vLLM's fused MoE serves
FP8_TENSOR = Recipe((Rule(("Linear",), weight=Role(presets.FP8_PER_TENSOR, "memoryless_minmax"),
                          input=Role(QuantSpec("fp8_e4m3", Tensor()), "minmax")),), name="fp8t")


@pytest.mark.parametrize("preset, leaf", [(FP8_TENSOR, "input_scale"),
                                          ("nvfp4", "input_global_scale")], ids=str)
def test_check_flags_experts_whose_input_scales_differ(preset, leaf, tmp_path, capsys):
    """vLLM's fused MoE layer keeps one input scale for all experts' w13 and one for their w2
    (FP8: ``w13_input_scale.max()``; FlashInfer NVFP4: one input global scale): experts of one
    module that disagree are flagged, per module and input, naming each expert's value."""
    from safetensors.torch import save_file

    from quantscope.cli import main

    model, batches = mixtral()
    calib = calibrate(model, batches, preset, progress=False)
    calib.export(model, tmp_path / "ct")
    assert check(tmp_path / "ct") == []
    (f,) = (tmp_path / "ct").glob("*.safetensors")
    tensors = _tensors(tmp_path / "ct")
    module = "model.layers.1.block_sparse_moe.experts"
    for shard in ("w1", "w3", "w2"):  # expert 2's w1 / w3 still agree with each other
        key = f"{module}.2.{shard}.{leaf}"
        tensors[key] = tensors[key] * 2
    save_file(tensors, str(f), metadata={"format": "pt"})
    problems = check(tmp_path / "ct")
    assert sorted((p["group"], p["tensor"], p["experts"]) for p in problems) == [
        (module, leaf, "w13"), (module, leaf, "w2")]
    w2 = next(p for p in problems if p["experts"] == "w2")
    assert w2["values"] == {f"{module}.{e}.w2": float(tensors[f"{module}.{e}.w2.{leaf}"])
                            for e in range(4)}
    assert len(set(w2["values"].values())) == 2
    assert main(["check", str(tmp_path / "ct")]) == 1
    out = capsys.readouterr().out
    assert f"{module}: {leaf} differs across the experts' w2 inputs" in out
    assert f"{module}.2.w2=" in out
