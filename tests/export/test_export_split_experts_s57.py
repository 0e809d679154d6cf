"""An experts module quantized for some experts only (probe s57): an ignore list that holds
one expert's ``down_proj`` left the export quiet and ``quantscope check`` content, and
transformers (whose experts are one 3-D layer of one scheme) loaded the float expert's slot
with values that are not its weights (logits 0.67 off for fp8-dynamic, against 0.014 whole).
Now the export warns and ``check`` reports it, as for a fused layer split the same way."""

import warnings

import pytest
import torch

from quantscope.calibration import calibrate, preset
from quantscope.exporters import check
from quantscope.exporters.consistency import format_problems

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tiny_models import qwen3_moe

torch.set_num_threads(1)

EXPERTS = "model.layers.0.mlp.experts"


def _export(tmp_path, ignore):
    model, batches = qwen3_moe(layers=1)
    calib = calibrate(model, batches, preset("fp8-dynamic", ignore=("lm_head", *ignore)),
                      progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calib.export(model, tmp_path / "e")
    return tmp_path / "e", [str(w.message) for w in caught if "experts'" in str(w.message)]


def test_an_expert_left_float_beside_quantized_ones_warns_and_is_reported(tmp_path):
    folder, warned = _export(tmp_path, (r"re:.*experts\.3\.down_proj$",))
    (problem,) = [p for p in check(folder) if p.get("float")]
    assert problem["group"] == EXPERTS and problem["experts"] == "down_proj"
    assert problem["float"] == [f"{EXPERTS}.3.down_proj"]
    assert problem["layers"] == [f"{EXPERTS}.{e}.down_proj" for e in range(4)]
    line = format_problems([problem])
    assert line.startswith(f"{EXPERTS}: the experts' down_proj weights are quantized in 3 "
                           f"experts but float in 3.down_proj: the fused MoE layer runs one ")
    assert warned == [f"export compressed-tensors: {line}"]


def test_experts_all_float_or_all_quantized_are_quiet(tmp_path):
    folder, warned = _export(tmp_path, (r"re:.*experts\.\d+\.down_proj$",))
    assert not warned and not [p for p in check(folder) if p.get("float")]


def test_the_gate_up_slot_counts_experts_not_layers(tmp_path):
    # re-review s57: w13 holds gate_proj and up_proj of each expert; the line counted both
    # ("quantized in 6 experts" of 4)
    folder, _ = _export(tmp_path, (r"re:.*experts\.3\.gate_up_proj$",))  # (calibrate's name)
    (problem,) = [p for p in check(folder) if p.get("float")]
    assert problem["experts"] == "w13"
    assert problem["float"] == [f"{EXPERTS}.3.gate_proj", f"{EXPERTS}.3.up_proj"]
    assert f"{EXPERTS}: the experts' w13 weights are quantized in 3 experts but float in " \
           f"3.gate_proj, 3.up_proj:" in format_problems([problem])


@pytest.mark.parametrize(("floats", "listed", "more"), [(4, 4, False), (5, 4, True)])
def test_the_split_line_lists_the_first_four_float_experts(floats, listed, more):
    # s58 mutants: four are all named, a fifth is '...'
    group = "model.layers.0.mlp.experts"
    problem = {"group": group, "layers": [f"{group}.{e}.down_proj" for e in range(8)],
               "tensor": "weight", "values": {}, "experts": "down_proj",
               "float": [f"{group}.{e}.down_proj" for e in range(floats)]}
    line = format_problems([problem])
    named = line[line.find("but float in"):line.find(": the fused")]
    assert [f"{e}.down_proj" in named for e in range(5)] == [e < listed for e in range(5)]
    assert named.rstrip().endswith("...") is more
    assert f"quantized in {8 - floats} experts" in line
