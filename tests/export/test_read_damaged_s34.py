"""Damaged compressed-tensors folders read back (probe s34, llm-compressor 0.14 checkpoints):
a ``weight_shape`` whose values lie, a scale / zero point / global scale of other rows, a
missing asymmetric zero point. Each is a ValueError naming the safetensors files, the layer's
tensor, what it holds and what compressed-tensors writes there (docs/guide/deploy.md "The
folder"), never compressed-tensors' broadcasting error filed under config.json."""


import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from ct_damage import damaged, refusal
from safetensors.torch import load_file

from quantscope import Channel, Group, QuantSpec, Tensor
from quantscope.calibration import Calibration, calibrate
from quantscope.calibration.recipe import Recipe, Role, Rule

torch.set_num_threads(1)
L = "model.layers.0.self_attn.q_proj"
HIDDEN = 32  # q_proj is HIDDEN x HIDDEN

RECIPES = {
    "int4_g16": Recipe((Rule(("Linear",), weight=Role(QuantSpec("int4", Group(16)),
                                                      "minmax")),)),
    "int4_g16_asym": Recipe((Rule(("Linear",), weight=Role(
        QuantSpec("int4", Group(16), symmetric=False), "minmax")),)),
    "int8_asym": Recipe((Rule(("Linear",), weight=Role(
        QuantSpec("int8", Channel(0), symmetric=False), "minmax"), input=Role(
        QuantSpec("int8", Tensor(), symmetric=False), "minmax")),), ("lm_head",), "asym"),
}


def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, [{"input_ids": torch.randint(0, 50, (1, 8))} for _ in range(2)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """name -> folder: the tiny Llama exported by quantscope as int4 groups of 16
    (pack-quantized, symmetric and asymmetric), asymmetric int8 with a static input
    (int-quantized), W8A8 and NVFP4."""
    out = {}
    for name in ("int4_g16", "int4_g16_asym", "int8_asym", "w8a8", "nvfp4"):
        model, batches = _tiny_llama()
        folder = tmp_path_factory.mktemp("ct") / name
        calibrate(model, batches, RECIPES.get(name, name), progress=False).export(model, folder)
        out[name] = folder
    return out


def _refusal(folder) -> str:
    msg = refusal(folder)  # the tensor files, not config.json
    assert "config.json: config_groups" not in msg, msg
    return msg


def test_the_undamaged_exports_read_back(exports):
    for folder in exports.values():
        assert L in Calibration.from_compressed_tensors(folder).states


@pytest.mark.parametrize("lie", [[HIDDEN // 2, HIDDEN], [2 * HIDDEN, HIDDEN],
                                 [HIDDEN, 2 * HIDDEN], [HIDDEN, HIDDEN, 1]])
def test_a_lying_weight_shape_names_what_it_holds_and_the_layer(exports, tmp_path, lie):
    # the message said "weight_shape is torch.int64 [2], but ... stored as torch.int64 [2]"
    def edit(t):
        t[f"{L}.weight_shape"] = torch.tensor(lie)
    folder, tensors = damaged(exports["int4_g16"], tmp_path / "ck", edit)
    written = tensors[f"{L}.weight_shape"].tolist()
    assert written == [HIDDEN, HIDDEN]  # what the exporter wrote: the layer's shape
    msg = _refusal(folder)
    assert f"{L}.weight_shape holds {lie}" in msg, msg
    assert f"is {written}" in msg, msg


def _rows(leaf, n):
    def edit(t):
        t[f"{L}.{leaf}"] = t[f"{L}.{leaf}"][:n].clone()
    return edit


@pytest.mark.parametrize("export, leaf, edit", [
    ("w8a8", "weight_scale", _rows("weight_scale", HIDDEN // 2)),  # a channel scale
    ("w8a8", "weight_scale", _rows("weight_scale", HIDDEN - 3)),
    ("int4_g16", "weight_scale", _rows("weight_scale", HIDDEN // 2)),  # a group scale
    ("int4_g16_asym", "weight_zero_point", _rows("weight_zero_point", 2)),  # packed rows
    ("int8_asym", "weight_zero_point", _rows("weight_zero_point", HIDDEN // 2)),
    ("nvfp4", "weight_scale", _rows("weight_scale", HIDDEN // 2)),
    ("nvfp4", "weight_global_scale", lambda t: t.__setitem__(
        f"{L}.weight_global_scale", t[f"{L}.weight_global_scale"].repeat(2))),
])
def test_a_qparam_of_other_rows_names_the_tensor_and_the_written_shape(exports, tmp_path,
                                                                       export, leaf, edit):
    # compressed-tensors' decoder refused these with "The size of tensor a (32) must match
    # the size of tensor b (16)", filed under config.json
    folder, tensors = damaged(exports[export], tmp_path / "ck", edit)
    got = list(load_file(next(folder.glob("*.safetensors")))[f"{L}.{leaf}"].shape)
    want = list(tensors[f"{L}.{leaf}"].shape)  # as the exporter (compressed-tensors) wrote it
    assert got != want
    msg = _refusal(folder)
    assert f"{L}.{leaf} has shape {got}, expected {want}" in msg, msg


@pytest.mark.parametrize("export, leaf, role", [
    ("int4_g16_asym", "weight_zero_point", "weights"),  # was compressed-tensors' assert
    ("int8_asym", "weight_zero_point", "weights"),
    ("int8_asym", "input_zero_point", "input activations"),  # was read as 0 without a word
])
def test_a_missing_asymmetric_zero_point_is_named(exports, tmp_path, export, leaf, role):
    folder, tensors = damaged(exports[export], tmp_path / "ck",
                               lambda t: t.pop(f"{L}.{leaf}"))
    assert bool(tensors[f"{L}.{leaf}"].ne(0).any())  # a zero point that matters was dropped
    msg = _refusal(folder)
    assert f"asymmetric {role} need {L}.{leaf}" in msg, msg
