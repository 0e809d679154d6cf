"""Reading llm-compressor's FP8 checkpoints of MoE models with 3-D experts: llm-compressor
calibrates an expert's gate and up apart, so their per-tensor float8 ``weight_scale``s
differ; vLLM serves them re-quantized to the larger of the two
(``process_fp8_weight_tensor_strategy_moe``), and ``from_compressed_tensors`` reads the
larger. Scales vLLM does not reconcile (an NVFP4 weight global scale) stay refused."""

import warnings

import pytest
import torch

from quantscope.calibration import Calibration, calibrate
from quantscope.calibration.recipe import scheme

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tiny_models import mixtral

IGNORE = ["lm_head", r"re:.*mlp\.gate$"]
DISK = "model.layers.{}.block_sparse_moe.experts.{}.{}"


def _rewrite(folder, fn):
    from safetensors.torch import load_file, save_file

    (f,) = folder.glob("*.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return tensors


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


def test_nvfp4_global_scales_that_differ_are_still_refused(tmp_path):
    model, batches = mixtral()
    calibrate(model, batches, "nvfp4", progress=False).export(model, tmp_path / "ct")
    key = DISK.format(0, 1, "w3.weight_global_scale")

    def edit(tensors):
        tensors[key] = tensors[key] * 2

    _rewrite(tmp_path / "ct", edit)
    with pytest.raises(ValueError, match=r"experts model\.layers\.0\.mlp\.experts\.1: gate "
                                         r"and up hold different per-tensor global scales"):
        Calibration.from_compressed_tensors(tmp_path / "ct")
