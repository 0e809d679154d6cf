"""A KV-cache-only calibration (no Linear quantized): exported as llm-compressor writes it
(empty ``config_groups`` beside the ``kv_cache_scheme``) and read back."""

import json

import pytest
import torch

from quantscope.calibration import Calibration, Recipe, Role, calibrate
from quantscope.calibration.recipe import KV_CACHE
from quantscope.qparams import qparams_from_range

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tiny_models import llama


def test_a_recipe_calibrating_the_kv_cache_needs_no_rule():
    kv = Role(KV_CACHE["fp8"], "minmax")
    assert Recipe((), kv_cache="fp8").kv_cache == kv
    assert Recipe.from_dict(json.loads(json.dumps(Recipe((), kv_cache=kv).to_dict()))) == \
        Recipe((), kv_cache=kv)
    with pytest.raises(ValueError, match="needs at least one rule or a kv_cache"):
        Recipe(())


def test_kv_cache_only_export_is_llm_compressors_layout_and_reads_back(tmp_path):
    from compressed_tensors.quantization import QuantizationArgs
    from safetensors.torch import load_file

    model, batches = llama()
    calib = calibrate(model, batches, Recipe((), kv_cache="fp8"), progress=False)
    assert all(set(r) == {"key", "value"} for r in calib.states.values())
    out = tmp_path / "ct"
    calib.export(model, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"] == {}
    assert qc["quantization_status"] == "compressed" and qc["format"] == "dense"
    kv = QuantizationArgs.model_validate(qc["kv_cache_scheme"])
    assert (kv.type, kv.num_bits, kv.strategy, kv.dynamic, kv.symmetric) == \
        ("float", 8, "tensor", False, True)
    tensors = load_file(out / "model.safetensors")
    # the weights stay float, every tensor the model's
    for name, param in model.state_dict().items():
        if name in tensors:
            assert torch.equal(tensors[name], param), name
    back = Calibration.from_compressed_tensors(out)
    assert back.recipe.rules == () and back.recipe.kv_cache.spec == KV_CACHE["fp8"]
    assert set(back.states) == {f"model.layers.{i}.self_attn" for i in range(2)}
    for name, roles in back.states.items():
        for role, key in (("key", "k_scale"), ("value", "v_scale")):
            assert torch.equal(roles[role].qparams.scale.reshape(1), tensors[f"{name}.{key}"])
            # the scale is the fp8 min-max scale of what the calibration observed
            st = calib.states[name][role]
            want = qparams_from_range(st.lo.reshape(1), st.hi.reshape(1), KV_CACHE["fp8"])
            assert torch.equal(tensors[f"{name}.{key}"], want.scale.reshape(1))
