"""Pins found by mutation (s36, second run): a figure saved at the dpi asked for; an empty
parameter store that looks like an offload cache copies nothing; and an input-only recipe's
fusion groups (layers reading one input) found, recorded and kept in float together."""

from __future__ import annotations

import struct

import pytest
import torch
from torch import nn

torch.set_num_threads(1)


# ---- plots: the dpi --------------------------------------------------------------------------

def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        data = f.read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_figures_are_saved_at_the_dpi_asked_for(tmp_path):
    """save_figure(dpi=120) draws 120 pixels an inch, whatever the figure's own dpi (a PNG
    of w x h inches is 120 w x 120 h pixels); Sensitivity.plot saves at 120 dpi."""
    matplotlib = pytest.importorskip("matplotlib")
    from quantscope.calibration.choice.ranking import Sensitivity
    from quantscope.calibration.results.plots import figure, save_figure

    fig = figure(figsize=(4, 2), dpi=100)
    fig.subplots().plot([0, 1], [0, 1])
    assert _png_size(save_figure(fig, tmp_path / "f.png", dpi=120)) == (480, 240)
    assert _png_size(save_figure(fig, tmp_path / "g.png")) == (400, 200)  # the figure's own

    rows = [{"rank": i + 1, "layer": f"l{i}", "role": "weight", "observer": "minmax",
             "divergence": 10.0 ** -i} for i in range(5)]
    with matplotlib.rc_context({"figure.dpi": 72}):  # not the 120 asked for
        Sensitivity(rows, {"metric": "kl"}).plot(tmp_path / "s.png")
    w, h = _png_size(tmp_path / "s.png")
    assert w == 8 * 120, (w, h)  # figsize (8, 0.22 n + 1.2) inches
    assert abs(h - (0.22 * 5 + 1.2) * 120) <= 1, (w, h)


# ---- placement: an empty parameter store -----------------------------------------------------

class _Cache(dict):
    """A module's ``_parameters`` of another type than dict, with the offload devices of
    compressed-tensors' OffloadCache (to disk: each read of a parameter a fresh copy)."""
    onload_device, offload_device = "cpu", "disk"


def test_an_empty_offload_store_copies_nothing():
    """A module holding no parameter (a Sequential, a block) whose empty ``_parameters``
    looks like an offload cache has nothing to copy: the model is not refused as offloaded,
    while a layer whose weight such a store holds is."""
    from quantscope.calibration.structure.placement import check_placement, loaded_copies

    model = nn.Sequential(nn.Linear(2, 2))
    model._parameters = _Cache()
    assert loaded_copies(model) is None
    check_placement(model, "calibrate")  # passes

    model[0]._parameters = _Cache(model[0]._parameters)
    assert loaded_copies(model[0]) == "_Cache offloading to disk"
    with pytest.raises(ValueError, match=r"parameters of '0' are offloaded"):
        check_placement(model, "calibrate")


# ---- fusion: an input-only recipe ------------------------------------------------------------

ATT, MLP = "model.layers.{}.self_attn.{}_proj", "model.layers.{}.mlp.{}_proj"


def _groups(n_layers=2):
    return [{ATT.format(i, p) for p in "qkv"} for i in range(n_layers)] + \
        [{MLP.format(i, p) for p in ("gate", "up")} for i in range(n_layers)]


@pytest.fixture(scope="module")
def input_only():
    """A tiny Llama calibrated with static per-tensor int8 inputs and no weight role, taking
    6 inputs out (keep_float=6; the default mode: dynamic per-token inputs)."""
    pytest.importorskip("transformers")
    from tiny_models import llama

    from quantscope import QuantSpec, calibrate
    from quantscope.calibration import Outliers, Recipe, Role, Rule
    from quantscope.layout import Tensor

    model, batches = llama()
    rec = Recipe(Rule(("Linear",), input=Role(QuantSpec("int8", Tensor()), "minmax")),
                 ("lm_head",))
    return calibrate(model, batches, rec, progress=False, outliers=Outliers(keep_float=6))


def test_an_input_only_recipe_finds_and_records_fusion_groups(input_only):
    """q / k / v (and gate / up) read one input, which the runtime quantizes once: with only
    input roles, the pass still finds those groups (info["fusion_groups"]), their input
    shared, and the members of a group that stays quantized share one input scale."""
    found = input_only.info.get("fusion_groups") or []
    assert sorted(map(sorted, (set(g["layers"]) for g in found))) == \
        sorted(map(sorted, _groups())), found
    assert all(g["input"] == "shared" for g in found), found
    for group in _groups():
        held = [input_only.states[m]["input"] for m in sorted(group)]
        scales = {s.qparams.scale.item() for s in held if not s.dynamic}
        assert len(scales) <= 1, (group, scales)


def test_keep_float_takes_a_fusion_groups_inputs_out_together(input_only):
    """keep_float takes whole groups' inputs out of static quantization (the runtime holds
    one input for q / k / v, one for gate / up): never one member of a group alone, and more
    than the 6 asked for where a group's member is among them."""
    kept = {t.rsplit(" ", 1)[0] for t in input_only.info["keep_float"]["tensors"]
            if t.endswith(" input")}
    assert len(kept) > 6, kept
    partial = [sorted(g) for g in _groups() if g & kept and not g <= kept]
    assert not partial, (partial, sorted(kept))
    assert any(g <= kept for g in _groups()), sorted(kept)
    assert input_only.info["keep_float"]["mode"] == "dynamic"  # (the default)
    for layer, roles in input_only.states.items():  # the kept ones quantized per token
        assert roles["input"].dynamic is (layer in kept), (layer, roles["input"])
