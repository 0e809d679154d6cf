"""Save / load keep act-order groups and check every role as calibration makes it; the
report explains an infinite SQNR (probe s32, results)."""

import dataclasses
import json
import math
import os

import pytest
import torch
from saved_edits import edit_saved

import quantscope
from quantscope import presets
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.calibration.results.io import load
from quantscope.layout import Group

safetensors_torch = pytest.importorskip("safetensors.torch")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.proj(x)


def _saved(tmp_path, recipe, meta=None, tensors=None):
    """A calibration of ``Net`` saved to ``tmp_path/c``, its JSON / tensors edited."""
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 16)
    calib = quantscope.calibrate(model, [x], recipe, progress=False)
    path = str(tmp_path / "c")
    calib.save(path)
    edit_saved(path, meta, tensors)
    return model, x, calib, path


def _act_order_recipe(g_idx):
    spec = dataclasses.replace(presets.INT4_GROUP128, layout=Group(4, g_idx=g_idx))
    return Recipe([Rule(("Linear",), weight=Role(spec, "minmax"))], name="actorder")


def _g_idx():
    torch.manual_seed(1)
    return torch.randperm(16) % 4  # 4 groups of 4 columns, scattered


# -- 1. act-order groups ----------------------------------------------------------------


def test_act_order_g_idx_saved_and_rebuilt(tmp_path):
    g = _g_idx()
    model, x, calib, path = _saved(tmp_path, _act_order_recipe(g))
    stored = safetensors_torch.load_file(os.path.join(path, "qparams.safetensors"))
    assert torch.equal(stored["proj/weight/g_idx"], g.long())
    loaded = load(path)
    lay = loaded.states["proj"]["weight"].spec.layout
    assert isinstance(lay, Group) and torch.equal(lay.g_idx, g)
    assert lay.order == calib.states["proj"]["weight"].spec.layout.order is not None
    with calib.apply(model):
        y_calib = model(x)
    with loaded.apply(model):
        y_loaded = model(x)
    assert torch.equal(y_calib, y_loaded) and calib.quantizes_like(loaded)


def test_column_order_groups_store_no_g_idx(tmp_path):
    recipe = Recipe([Rule(("Linear",), weight=Role(dataclasses.replace(
        presets.INT4_GROUP128, layout=Group(4)), "minmax"))], name="plain")
    _, _, calib, path = _saved(tmp_path, recipe)
    stored = safetensors_torch.load_file(os.path.join(path, "qparams.safetensors"))
    assert not any(k.endswith("/g_idx") for k in stored)
    loaded = load(path)
    assert loaded.states["proj"]["weight"].spec.layout.g_idx is None
    assert calib.quantizes_like(loaded)


@pytest.mark.parametrize("bad", [
    torch.arange(16) % 5,                  # a group index past the 4 groups
    torch.arange(8) % 2,                   # 8 entries for 16 columns
    (torch.arange(16) % 4).float(),        # not integers
    (torch.arange(16) % 4).reshape(4, 4),  # not 1-D
])
def test_bad_g_idx_refused_naming_the_key(tmp_path, bad):
    def edit(t):
        t["proj/weight/g_idx"] = bad.contiguous()
    *_, path = _saved(tmp_path, _act_order_recipe(_g_idx()), tensors=edit)
    with pytest.raises(ValueError, match="proj/weight/g_idx"):
        load(path)


def test_g_idx_on_a_layout_without_groups_refused(tmp_path):
    def edit(t):
        t["proj/weight/g_idx"] = torch.arange(16) % 4
    *_, path = _saved(tmp_path, "w8a8", tensors=edit)
    with pytest.raises(ValueError, match="proj/weight/g_idx"):
        load(path)


# -- 2. a static weight records its shape ----------------------------------------------


def test_static_weight_shape_null_refused(tmp_path):
    def edit(j):
        j["layers"]["proj"]["weight"]["shape"] = None
    *_, path = _saved(tmp_path, "w8a8", meta=edit)
    with pytest.raises(ValueError, match=r"layers\.proj\.weight\.shape"):
        load(path)


def test_activation_shape_null_still_loads(tmp_path):
    _, _, calib, path = _saved(tmp_path, "w8a8")
    with open(os.path.join(path, "quantscope.json")) as f:
        assert json.load(f)["layers"]["proj"]["input"]["shape"] is None
    assert calib.quantizes_like(load(path))


# -- 3. a role as Role() takes it ------------------------------------------------------


def test_local_mode_on_int8_refused(tmp_path):
    def edit_meta(j):
        j["layers"]["proj"]["input"]["dynamic"] = "local"

    def edit_tensors(t):
        for k in [k for k in t if k.startswith("proj/input/")]:
            t.pop(k)
        t["proj/input/global_amax"] = torch.tensor(1.0)
    *_, path = _saved(tmp_path, "w8a8", edit_meta, edit_tensors)
    with pytest.raises(ValueError) as e:
        load(path)
    with pytest.raises(ValueError) as role_error:  # the reason Role itself gives
        Role(presets.INT8_PER_TENSOR, "minmax", "local")
    assert "layers.proj.input.dynamic" in str(e.value)
    assert str(role_error.value) in str(e.value)


# -- 4. a run-time role's observer -----------------------------------------------------


@pytest.mark.parametrize("field, value", [("observer", "no_such_observer"),
                                          ("options", {"no_such_option": 1})])
def test_dynamic_role_observer_checked(tmp_path, field, value):
    def edit(j):
        j["layers"]["proj"]["input"][field] = value
    *_, path = _saved(tmp_path, "w8a8-dynamic", meta=edit)
    with pytest.raises(ValueError, match=r"quantscope\.json: layers\.proj\.input\.observer"):
        load(path)


def test_dynamic_role_other_registered_observer_loads(tmp_path):
    def edit(j):
        j["layers"]["proj"]["input"]["observer"] = "minmax"
    *_, path = _saved(tmp_path, "w8a8-dynamic", meta=edit)
    assert load(path).states["proj"]["input"].observer == "minmax"


# -- 5. role names ---------------------------------------------------------------------


def test_unknown_role_refused(tmp_path):
    def edit(j):
        j["layers"]["proj"]["kernel"] = j["layers"]["proj"]["input"]
    *_, path = _saved(tmp_path, "w8a8-dynamic", meta=edit)
    with pytest.raises(ValueError, match=r"layers\.proj\.kernel: unknown role 'kernel'"):
        load(path)


# -- 6. infinite SQNR explained --------------------------------------------------------


def _report(weight, recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    with torch.no_grad():
        model[0].weight.copy_(weight)
    return quantscope.calibrate(model, [torch.randn(4, 16)], recipe, progress=False).report()


def _exact_weights():
    """fp8 e4m3 values times 2**-7, each row reaching 448: per-channel min-max gives the
    scale amax / 448 = 2**-7, and QDQ gives every value back."""
    torch.manual_seed(2)
    codes = (torch.rand(8, 16) * 896 - 448).to(torch.float8_e4m3fn).float()
    codes[:, 0] = 448
    return codes * 2.0 ** -7


@pytest.mark.parametrize("weight, recipe", [(torch.zeros(8, 16), "w8a8"),
                                            (_exact_weights(), "fp8")],
                         ids=["zero", "representable"])
def test_infinite_sqnr_explained(weight, recipe):
    report = _report(weight, recipe)
    w_row = next(r for r in report.rows if r["role"] == "weight")
    assert w_row["sqnr_db"] == math.inf  # no error: kept as the value
    notes = [n for n in report.notes if "no quantization error" in n]
    assert len(notes) == 1 and "0 weight" in notes[0] and "0 input" not in notes[0]
    md = report.to_markdown()
    assert f"Note: {notes[0]}" in md
    js = json.loads(report.to_json())
    rows = {r["role"]: r for r in js["layers"]}
    assert rows["weight"]["sqnr_db"] is None and rows["weight"]["sqnr_exact"] is True
    assert rows["input"]["sqnr_exact"] is False
    assert math.isfinite(rows["input"]["sqnr_db"])
    assert js["summary"]["weight"]["exact_layers"] == 1
    assert js["summary"]["input"]["exact_layers"] == 0


def test_no_exact_note_for_ordinary_layers():
    torch.manual_seed(3)
    report = _report(torch.randn(8, 16), "w8a8")
    assert not any("no quantization error" in n for n in report.notes)
    assert all(r["sqnr_exact"] is False for r in json.loads(report.to_json())["layers"])
