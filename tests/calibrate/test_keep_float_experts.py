"""keep_float takes an MoE experts module's inputs out whole: vLLM's fused MoE layer holds one
w13 (gate / up) input scale and one w2 (down) input scale per experts module and runs one
scheme, so all its experts' gate / up inputs are one unit and their down inputs another
(found by probing: each expert's input was ranked and taken out on its own, leaving one
module with some experts static and others dynamic)."""

import warnings
from dataclasses import replace

import pytest

import quantscope
from quantscope.calibration import Outliers
from quantscope.calibration.choice.sensitivity import Sensitivity, keep_float

transformers = pytest.importorskip("transformers")

from tiny_models import qwen3_moe

EXPERTS = "model.layers.{}.mlp.experts"


def _modes(calib) -> dict:
    """``{(experts module, slot layer): {expert: "static" / "dynamic" / "none"}}``."""
    out = {}
    for layer, roles in calib.states.items():
        module, e, proj = (["", ""] + layer.rsplit(".", 2))[-3:]
        if module.endswith(".experts") and e.isdigit():
            st = roles.get("input")
            mode = "none" if st is None else ("dynamic" if st.dynamic is True else "static")
            out.setdefault((module, proj), {})[int(e)] = mode
    return out


@pytest.fixture(scope="module")
def qwen():
    return qwen3_moe()


@pytest.fixture(scope="module")
def fp8(qwen):
    return quantscope.calibrate(*qwen, "fp8", progress=False)


def _rows(*layers):
    return Sensitivity([{"layer": layer, "role": "input", "observer": "minmax",
                         "divergence": 1.0 / k} for k, layer in enumerate(layers, 1)])


@pytest.mark.parametrize("mode", ["float", "dynamic"])
def test_one_expert_ranked_takes_its_experts_module_slot(fp8, mode):
    sens = _rows(f"{EXPERTS.format(1)}.2.down_proj", f"{EXPERTS.format(0)}.3.gate_up_proj",
                 f"{EXPERTS.format(0)}.1.gate_up_proj")
    kept = keep_float(fp8, sens, 2, mode=mode)
    assert kept.info["keep_float"]["n"] == 2  # one unit each, counted once
    want = {f"{EXPERTS.format(i)}.{e}.{p} input" for i, p in ((1, "down_proj"),
                                                               (0, "gate_up_proj"))
            for e in range(4)}
    assert set(kept.info["keep_float"]["tensors"]) == want
    out = "none" if mode == "float" else "dynamic"
    modes = _modes(kept)
    assert modes[(EXPERTS.format(1), "down_proj")] == dict.fromkeys(range(4), out)
    assert modes[(EXPERTS.format(0), "gate_up_proj")] == dict.fromkeys(range(4), out)
    assert modes[(EXPERTS.format(0), "down_proj")] == dict.fromkeys(range(4), "static")


def test_module_list_experts_w1_w3_one_unit_w2_another(fp8):
    # older checkpoints' experts: a ModuleList of w1 / w3 / w2 Linears, w1 / w3 fused per expert
    names = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
    states, groups = {}, []
    for layer, roles in fp8.states.items():
        module, e, proj = (["", ""] + layer.rsplit(".", 2))[-3:]
        for new in names.get(proj, ()) if module.endswith(".experts") else ():
            states[f"{module}.{e}.{new}"] = dict(roles)
        if proj == "gate_up_proj":
            groups.append({"layers": [f"{module}.{e}.w1", f"{module}.{e}.w3"],
                           "weight": "per layer", "input": "shared"})
    calib = replace(fp8, states=states, stats=[], histograms={},
                    info=dict(fp8.info, fusion_groups=groups))
    kept = keep_float(calib, _rows(f"{EXPERTS.format(0)}.2.w3", f"{EXPERTS.format(0)}.1.w2",
                                   f"{EXPERTS.format(1)}.0.w1"), 2)
    assert kept.info["keep_float"]["n"] == 2
    assert sorted(kept.info["keep_float"]["tensors"]) == sorted(
        f"{EXPERTS.format(0)}.{e}.{p} input" for e in range(4) for p in ("w1", "w2", "w3"))
    assert all("input" in kept.states[f"{EXPERTS.format(1)}.{e}.{p}"]
               for e in range(4) for p in ("w1", "w2", "w3"))


def test_calibrate_keep_float_leaves_no_experts_module_split(qwen):
    model, batches = qwen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = quantscope.calibrate(model, batches[:2], "fp8", progress=False,
                                     outliers=Outliers(keep_float=5))
    modes = _modes(calib)
    assert {k: v for k, v in modes.items() if len(set(v.values())) > 1} == {}
    kept = calib.info["keep_float"]
    assert kept["n"] == 5
    out = {k for k, v in modes.items() if set(v.values()) != {"static"}}
    assert out  # the ranking took at least one experts module's slot
    assert {t.rsplit(".", 1)[0] for t in kept["tensors"] if ".experts." in t} == {
        f"{m}.{e}" for m, _ in out for e in range(4)}
