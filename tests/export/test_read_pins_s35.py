"""Pins of behaviours no test held (mutation run s35) in reading compressed-tensors folders
back: a per-tensor scale stored with another shape of one value reads as the same scale; of
several damaged tensors the weight's is named first; an unpacked zero point where a packed
one is written is named with its dtype."""


import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from ct_damage import damaged, refusal
from safetensors.torch import load_file

from quantscope import Group, QuantSpec, Tensor
from quantscope.calibration import Calibration, calibrate
from quantscope.calibration.recipe import Recipe, Role, Rule

torch.set_num_threads(1)
L = "model.layers.0.self_attn.q_proj"
HIDDEN = 32  # q_proj is HIDDEN x HIDDEN

RECIPES = {
    "fp8_tensor": Recipe((Rule(("Linear",), weight=Role(QuantSpec("fp8_e4m3", Tensor()),
                                                        "minmax")),), ("lm_head",), "fp8t"),
    "int4_g16_asym": Recipe((Rule(("Linear",), weight=Role(
        QuantSpec("int4", Group(16), symmetric=False), "minmax")),), ("lm_head",), "i4a"),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """name -> folder: a tiny Llama exported by quantscope with per-tensor fp8 weights
    (float-quantized, a scale of shape [1]) and asymmetric int4 groups of 16
    (pack-quantized: the zero point packed as int32 [rows / 8, groups])."""
    out = {}
    for name, recipe in RECIPES.items():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=50)
        model = transformers.LlamaForCausalLM(cfg).eval()
        batches = [{"input_ids": torch.randint(0, 50, (1, 8))} for _ in range(2)]
        folder = tmp_path_factory.mktemp("ct") / name
        calibrate(model, batches, recipe, progress=False).export(model, folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("shape", [(), (1, 1)])
def test_a_per_tensor_scale_stored_0d_or_1x1_reads_as_the_same(exports, tmp_path,
                                                                         shape):
    # one value is a per-tensor scale, 0-d or [1, 1] as well as [1], as the reader takes a
    # qparam (compressed-tensors' own decoder broadcasts these onto the 2-D weight)
    def edit(t):
        t[f"{L}.weight_scale"] = t[f"{L}.weight_scale"].reshape(shape).clone()
    folder, tensors = damaged(exports["fp8_tensor"], tmp_path / "ck", edit)
    assert list(tensors[f"{L}.weight_scale"].shape) == [1]  # as the exporter wrote it
    assert list(load_file(next(folder.glob("*.safetensors")))[f"{L}.weight_scale"].shape) == \
        list(shape)
    want = Calibration.from_compressed_tensors(exports["fp8_tensor"]).states[L]["weight"]
    got = Calibration.from_compressed_tensors(folder).states[L]["weight"]
    assert torch.equal(got.qparams.scale, want.qparams.scale)
    assert got.qparams.scale.reshape(()) == tensors[f"{L}.weight_scale"].reshape(())
    assert got.quantizes_like(want)


def test_of_several_damaged_tensors_the_weights_is_named_first(exports, tmp_path):
    def edit(t):  # both of other rows: the packed codes and the group scales
        for leaf in ("weight_scale", "weight_packed"):  # (the scale first in the file's dict)
            t[f"{L}.{leaf}"] = t[f"{L}.{leaf}"][:HIDDEN // 2].clone()
    folder, tensors = damaged(exports["int4_g16_asym"], tmp_path / "ck", edit)
    packed = list(tensors[f"{L}.weight_packed"].shape)
    assert packed == [HIDDEN, HIDDEN // 8]  # eight int4 codes an int32
    msg = refusal(folder)
    assert f"{L}: weight_packed is torch.int32 [{HIDDEN // 2}, {HIDDEN // 8}]" in msg, msg
    assert f"stored as torch.int32 {packed}" in msg, msg
    assert "weight_scale" not in msg, msg


def test_an_unpacked_zero_point_is_named_with_its_dtype(exports, tmp_path):
    folder = exports["int4_g16_asym"]
    zp = Calibration.from_compressed_tensors(folder).states[L]["weight"].qparams.zero_point
    unpacked = zp.reshape(HIDDEN, HIDDEN // 16).to(torch.int8).contiguous()  # one per group

    def edit(t):
        t[f"{L}.weight_zero_point"] = unpacked
    folder, tensors = damaged(folder, tmp_path / "ck", edit)
    packed = tensors[f"{L}.weight_zero_point"]
    assert packed.dtype == torch.int32 and list(packed.shape) == [HIDDEN // 8, HIDDEN // 16]
    msg = refusal(folder)
    assert (f"{L}: weight_zero_point is torch.int8 [{HIDDEN}, {HIDDEN // 16}], but the "
            f"config's weights") in msg, msg
    assert f"stored as torch.int32 {list(packed.shape)}" in msg, msg
