"""A stored ``weight_g_idx`` (probe s27 actorder): reading a compressed-tensors folder refuses
one that moves columns, naming it, where it dropped it without a word; -1s (the placeholder
until GPTQ fills it) and column order read as plain groups."""

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors.torch import load_file, save_file

from quantscope import Group, QuantSpec
from quantscope.calibration import Calibration, calibrate
from quantscope.calibration.recipe import Recipe, Role, Rule

torch.set_num_threads(1)
LAYER = "model.layers.0.mlp.down_proj"  # 64 columns
INT4_G16 = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int4", Group(16)), "minmax")),))


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, [{"input_ids": torch.randint(0, 50, (1, 8))}]


@pytest.fixture(scope="module", params=["group16", "nvfp4", "w8a8"])
def exported(request, tmp_path_factory):
    """``(folder, group size or None)``: a tiny Llama exported as int4 groups of 16, NVFP4
    blocks of 16, or per-channel int8 (no group layout)."""
    model, batches = _tiny_llama()
    recipe = {"group16": INT4_G16}.get(request.param, request.param)
    out = tmp_path_factory.mktemp("ct") / request.param
    calibrate(model, batches, recipe, progress=False).export(model, out)
    return out, {"w8a8": None}.get(request.param, 16)


def _with_g_idx(src, dst, g_idx):
    folder = shutil.copytree(src, dst)
    (f,) = folder.glob("*.safetensors")
    tensors = load_file(f)
    tensors[f"{LAYER}.weight_g_idx"] = g_idx.to(torch.int32)
    save_file(tensors, f, metadata={"format": "pt"})
    return folder


def _scale(folder):
    return Calibration.from_compressed_tensors(folder).states[LAYER]["weight"].qparams.scale


def test_act_order_g_idx_is_refused_naming_it(exported, tmp_path):
    folder, _ = exported
    moved = torch.randperm(64, generator=torch.Generator().manual_seed(1)) // 16
    with pytest.raises(ValueError, match=r"weight_g_idx moves columns .*column-order groups "
                                         r"only \(compressed-tensors 0\.20"):
        Calibration.from_compressed_tensors(_with_g_idx(folder, tmp_path / "ck", moved))


def test_placeholder_g_idx_reads_as_plain_groups(exported, tmp_path):
    folder, _ = exported
    ck = _with_g_idx(folder, tmp_path / "ck", torch.full((64,), -1))
    assert torch.equal(_scale(ck), _scale(folder))


def test_column_order_g_idx_reads_as_plain_groups_where_groups_are(exported, tmp_path):
    folder, size = exported
    ck = _with_g_idx(folder, tmp_path / "ck", torch.arange(64) // (size or 64))
    if size is None:  # a per-channel weight has no groups for a g_idx to give
        with pytest.raises(ValueError, match="weight_g_idx moves columns"):
            Calibration.from_compressed_tensors(ck)
    else:
        assert torch.equal(_scale(ck), _scale(folder))


def test_g_idx_that_fits_no_group_is_refused(exported, tmp_path):
    folder, size = exported
    if size is None:
        pytest.skip("no group layout")
    ck = _with_g_idx(folder, tmp_path / "ck", torch.arange(64) // 32)  # 32 columns a group
    with pytest.raises(ValueError, match="weight_g_idx gives no column a group"):
        Calibration.from_compressed_tensors(ck)


# ------------------------------------------- a g_idx that moves no column: plain groups
def _state(g_idx):
    from quantscope.calibration.results.result import RoleState
    from quantscope.observers.minmax import MemorylessMinMaxObserver

    spec = QuantSpec("int4", Group(16, g_idx=g_idx))
    obs = MemorylessMinMaxObserver(spec)
    obs(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)))
    return RoleState(spec, "minmax", "minmax", False, qparams=obs.qparams(), shape=(8, 64))


IDENTITY, MOVED = torch.arange(64) // 16, torch.arange(64) % 4


def test_identity_g_idx_exports_compressed_tensors_groups():
    from quantscope.exporters.compressed_tensors import quant_args

    args = quant_args(_state(IDENTITY), "l", "weight")
    assert (args.strategy, args.group_size, args.actorder) == ("group", 16, None)
    with pytest.raises(ValueError, match="layout Group"):
        quant_args(_state(MOVED), "l", "weight")


def test_identity_g_idx_exports_onnx_groups_with_column_order_scales():
    pytest.importorskip("onnx")
    from onnx import numpy_helper

    from quantscope.exporters.onnx_graph import _weight_dq

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    got, node, _ = _weight_dq("l", _state(IDENTITY), w, False, "l", False)
    plain, _, _ = _weight_dq("l", _state(None), w, False, "l", False)
    assert {a.name: a.i for a in node.attribute}["block_size"] == 16
    for a, b in zip(got, plain):
        assert (numpy_helper.to_array(a) == numpy_helper.to_array(b)).all()
    with pytest.raises(ValueError, match="no DequantizeLinear form"):
        _weight_dq("l", _state(MOVED), w, False, "l", False)


def test_identity_g_idx_splits_across_fused_members():
    from quantscope.calibration.structure.fusion import splittable

    assert splittable(QuantSpec("int4", Group(16, g_idx=IDENTITY)))
    assert not splittable(QuantSpec("int4", Group(16, g_idx=MOVED)))
    assert splittable(QuantSpec("int4", Group(16)))
