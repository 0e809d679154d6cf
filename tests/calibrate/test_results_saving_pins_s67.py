"""Pins from the s67 mutation round over ``calibration/results`` (saving.py, role_state.py,
info_check.py and the matplotlib-free parts of plots.py): what ``save`` refuses and writes
(the label, the overwrite flag, tensors sharing storage, an int32 act-order ``g_idx``, a
bfloat16 smoothing scale, the format version), what ``RoleState.quantizes_like`` compares,
the shapes ``info_problem`` checks, and how the plots choose and lay out what they draw.
Each test holds a behaviour the module's docstrings define that no earlier test held."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from saved_edits import edit_saved
from test_results_s32 import _act_order_recipe, _g_idx
from test_save_names import _model, _with_smoothing
from torch import nn

from quantscope import QuantSpec, presets, qparams_from_range
from quantscope.calibration import calibrate, load
from quantscope.calibration.results import plots
from quantscope.calibration.results.info_check import info_problem
from quantscope.calibration.results.role_state import RoleState
from quantscope.calibration.results.saving import META, TENSORS, VERSION, save
from quantscope.layout import Group, Tensor

pytest.importorskip("safetensors")


def _calibration():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    return calibrate(model, [torch.randn(4, 8)], "w8a8", progress=False)


# -- saving.py ----------------------------------------------------------------------------


def test_save_refuses_a_model_for_a_calibration(tmp_path):
    with pytest.raises(TypeError, match=r"^save: calibration must be a Calibration .*got "
                                        r"Linear$"):
        save(nn.Linear(2, 2), tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_save_refuses_a_label_that_is_no_str(tmp_path):
    """load reads a str label back: save refuses another, writing nothing."""
    calib = _calibration()
    calib.label = 3
    with pytest.raises(TypeError, match=r"label must be a str, got 3"):
        calib.save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_save_refuses_an_overwrite_that_is_no_bool(tmp_path):
    with pytest.raises(ValueError, match=r"^save: overwrite must be True or False, got 'no'$"):
        _calibration().save(tmp_path / "c", overwrite="no")
    assert not (tmp_path / "c").exists()


def test_save_with_overwrite_false_keeps_an_earlier_calibration(tmp_path):
    calib = _calibration()
    path = calib.save(tmp_path / "c")
    before = (tmp_path / "c" / META).read_text()
    calib.label = "second"
    with pytest.raises(ValueError, match="overwrite=True"):
        calib.save(path, overwrite=False)
    assert (tmp_path / "c" / META).read_text() == before
    assert calib.save(path).endswith("c") and load(path).label == "second"


def test_save_writes_the_format_name_and_version_two(tmp_path):
    """VERSION is 2 (fingerprints on activation roles); the JSON says so."""
    path = _calibration().save(tmp_path / "c")
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    assert VERSION == 2
    assert (meta["format"], meta["version"]) == ("quantscope-calibration", 2)


def test_a_version_one_folder_loads(tmp_path):
    """READS is (1, 2): a version-1 folder (fingerprints on weight roles only) loads."""
    calib = _calibration()
    path = calib.save(tmp_path / "c")

    def to_v1(d):
        d["version"] = 1
        for roles in d["layers"].values():
            for role, entry in roles.items():
                if role != "weight":
                    entry.pop("fingerprint", None)
    edit_saved(path, meta=to_v1)
    assert load(path).quantizes_like(calib)


def test_save_keeps_the_requested_observer_apart_from_the_one_found(tmp_path):
    """``requested`` says ``"auto"`` where ``observer`` names the one auto chose."""
    calib = _calibration()
    st = calib.states["0"]["input"]
    calib.states["0"]["input"] = replace(st, requested="auto")
    got = load(calib.save(tmp_path / "c")).states["0"]["input"]
    assert (got.observer, got.requested) == (st.observer, "auto")


def test_save_writes_a_range_whose_lo_and_hi_are_one_tensor(tmp_path):
    """Tensors are cloned before safetensors writes them: a role whose lo and hi are the same
    tensor (a range of width 0, which safetensors refuses as shared memory) saves and loads."""
    calib = _calibration()
    st = calib.states["0"]["weight"]
    both = st.lo.clone()
    calib.states["0"]["weight"] = replace(st, lo=both, hi=both)
    got = load(calib.save(tmp_path / "c")).states["0"]["weight"]
    assert torch.equal(got.lo, st.lo) and torch.equal(got.hi, st.lo)


def test_an_int32_act_order_g_idx_is_stored_as_int64(tmp_path):
    """The tensors file holds an act-order group's ``g_idx`` as int64 (io's format), whatever
    integer dtype the layout was given; it loads back as that column order."""
    from safetensors.torch import load_file

    g = _g_idx().int()
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    calib = calibrate(model, [torch.randn(4, 16)], _act_order_recipe(g), progress=False)
    path = calib.save(tmp_path / "c")
    stored = load_file(os.path.join(path, TENSORS))["0/weight/g_idx"]
    assert stored.dtype == torch.int64 and torch.equal(stored, g.long())
    assert load(path).quantizes_like(calib)


def test_a_bfloat16_smoothing_scale_is_saved_as_float32(tmp_path):
    calib = _calibration()
    scale = torch.tensor([0.5, 1.25, 3.0], dtype=torch.bfloat16)
    back = load(_with_smoothing(calib, {"norm": scale}).save(tmp_path / "c"))
    assert back.smoothing["norm"].dtype == torch.float32
    assert torch.equal(back.smoothing["norm"], scale.float())


def test_a_smoothed_module_named_like_a_field_saves_without_a_layer_named_smooth(tmp_path):
    """Only a key a role of a layer ``#smooth`` would read is refused: a module named
    ``scale`` stores its SmoothQuant scale at ``#smooth/scale``, no role's key."""
    calib = _with_smoothing(_calibration(), {"scale": torch.ones(8)})
    back = load(calib.save(tmp_path / "c"))
    assert list(back.smoothing) == ["scale"]


def test_a_smoothing_key_beside_a_layer_named_smooth_is_refused_only_on_a_field(tmp_path):
    """``#smooth/input/norm`` names no field a role stores (``FIELDS``): it saves beside a
    layer ``#smooth`` whose input role is calibrated, and loads back as a smoothing scale."""
    model, batches = _model("#smooth", "b")
    calib = calibrate(model, batches, "w8a8", progress=False)
    back = load(_with_smoothing(calib, {"input/norm": torch.ones(16)}).save(tmp_path / "c"))
    assert list(back.smoothing) == ["input/norm"] and list(back.states) == ["#smooth", "b"]


# -- role_state.py ------------------------------------------------------------------------


def _static(spec=None, observer="minmax", **kw):
    spec = spec or QuantSpec("int8", Tensor())
    qp = qparams_from_range(torch.tensor([-1.0]), torch.tensor([1.0]), spec)
    return RoleState(spec, observer, observer, qparams=qp, **kw)


def test_act_order_states_with_another_column_order_quantize_differently():
    """Spec equality ignores ``g_idx``; quantizes_like compares the column order too."""
    g = torch.arange(16) % 4
    a = _static(QuantSpec("int4", Group(4, g_idx=g)))
    b = _static(QuantSpec("int4", Group(4, g_idx=g.flip(0))))
    assert a.spec == b.spec
    assert not a.quantizes_like(b)
    assert a.quantizes_like(_static(QuantSpec("int4", Group(4, g_idx=g.clone()))))


def test_a_static_roles_observer_does_not_matter_a_run_time_roles_does():
    spec = QuantSpec("int8", Tensor())
    assert _static(observer="minmax").quantizes_like(_static(observer="mse"))
    run = RoleState(spec, "minmax", "minmax", dynamic=True)
    assert run.quantizes_like(replace(run))
    assert not run.quantizes_like(replace(run, observer="absmax"))
    assert not run.quantizes_like(replace(run, options=(("percentile", 99.9),)))
    assert not run.quantizes_like(RoleState(spec, "minmax", "minmax", dynamic=False))


def test_a_local_roles_observer_and_options_do_not_matter():
    """``"local"`` roles are calibrated (their global amax): only a ``dynamic=True`` role's
    observer and options compute its qparams."""
    st = RoleState(presets.NVFP4, "minmax", "minmax", dynamic="local",
                   global_amax=torch.tensor([3.0]))
    assert st.quantizes_like(replace(st, observer="mse", options=(("x", 1),)))


def test_qparams_of_another_dtype_quantize_differently():
    """``torch.equal`` holds across dtypes; a float64 scale is no float32 one."""
    st = _static()
    qp = st.qparams
    wide = replace(st, qparams=replace(qp, scale=qp.scale.double()))
    assert torch.equal(qp.scale, wide.qparams.scale)
    assert not st.quantizes_like(wide)


def test_check_weight_refuses_a_transposed_weight_naming_the_layer():
    st = _static(shape=(8, 4))
    st.check_weight("apply", "fc", torch.zeros(8, 4))
    _static().check_weight("apply", "fc", torch.zeros(3))  # no shape recorded: any
    with pytest.raises(ValueError, match=r"^apply: fc\.weight has shape \(4, 8\), but was "
                                         r"calibrated with shape \(8, 4\)"):
        st.check_weight("apply", "fc", torch.zeros(4, 8))


def test_to_moves_every_tensor_and_keeps_the_rest():
    st = _static(lo=torch.tensor([-1.0]), hi=torch.tensor([2.0]), shape=(2, 2),
                 fingerprint="f")
    st = replace(st, global_amax=torch.tensor([5.0]))
    moved = st.to("meta")
    assert all(t.device.type == "meta" for t in (moved.qparams.scale, moved.global_amax,
                                                  moved.lo, moved.hi))
    assert (moved.spec, moved.shape, moved.fingerprint) == (st.spec, (2, 2), "f")
    assert st.lo.device.type == "cpu" and st.hi.device.type == "cpu"
    same = st.to("cpu")
    assert [t.tolist() for t in (same.lo, same.hi, same.global_amax)] == [[-1.0], [2.0], [5.0]]


# -- info_check.py ------------------------------------------------------------------------


@pytest.mark.parametrize(("info", "found"), [
    ({"eval_max_length": 256.0}, ("info.eval_max_length", "expected int, got float")),
    ({"fusion_groups": [{"layers": ["q"], "weight": "shared"}]},
     ("info.fusion_groups[0].input", "missing")),
    ({"keep_float": {"n": 1, "mode": "float", "tensors": [1]}},
     ("info.keep_float.tensors[0]", "expected str, got int")),
    ({"keep_float": {"n": 1, "tensors": []}}, ("info.keep_float.mode", "missing")),
    ({"experts": [{"module": "m", "expert": 0, "tokens": 2.5, "rule": "own"}]},
     ("info.experts[0].tokens", "expected int, got float")),
    ({"unreached": [{"name": "a"}, 1]}, ("info.unreached[0].why", "missing")),
    ({"model": 1, "task": 2}, ("info.model", "expected str, got int")),
])
def test_info_problem_names_the_first_entry_off_its_shape(info, found):
    assert info_problem(info) == found


@pytest.mark.parametrize("info", [
    {"calibration_seconds": 3},
    {"smooth": {"alpha": 1, "smoothed": [], "skipped": ["x"]}},
    {"experts": [{"module": "m", "expert": "e0", "tokens": 0, "rule": "own"}]},
])
def test_info_problem_takes_an_int_where_a_number_is_wanted(info):
    assert info_problem(info) is None


# -- plots.py: data and argument checks ---------------------------------------------------


def _input(layer, sqnr=30.0, dynamic=False):
    return {"layer": layer, "role": "input", "sqnr_db": sqnr, "dynamic": dynamic,
            "requested": "minmax", "observer": "minmax", "clip_lo": -1.0, "clip_hi": 1.0}


def _runs(**rows):
    return {f"{rec}/minmax": {"recipe": rec, "observer": "minmax", "layers": r}
            for rec, r in rows.items()}


def _hist(*layers):
    return {f"{k}/input": {"counts": [1, 2], "lo": -2.0, "hi": 2.0} for k in layers}


def test_report_recipes_leave_out_runs_without_a_recipe():
    report = {"runs": {"plain": {"layers": []}, **_runs(w8a8=[])}}
    assert plots.report_recipes(report) == ["w8a8"]


def test_histogram_layers_split_the_role_off_at_the_last_slash():
    report = {"histograms": {"blocks/0/input": {}, "blocks/0/output": {}}}
    assert plots.histogram_layers(report) == ["blocks/0"]


def test_without_histograms_every_static_row_is_drawable():
    report = {"runs": _runs(r1=[_input("a", dynamic=True)], r2=[_input("a"), _input("b")])}
    assert plots.drawable_recipes(report) == ["r2"]
    assert plots.pick_layer(report) in ("a", "b")


def test_an_sqnr_of_zero_db_counts_when_picking_the_layer():
    runs = {"w8a8/minmax": {"recipe": "w8a8", "layers": [_input("a", 0.0), _input("b", 10.0)]},
            "w8a8/mse": {"recipe": "w8a8", "layers": [_input("a", 5.0), _input("b", 12.0)]}}
    assert plots.pick_layer({"runs": runs}) == "a"  # spread 5 dB at a, 2 dB at b


def test_a_report_without_runs_is_refused():
    with pytest.raises(ValueError, match=r"^plot: the report has no runs: nothing to plot$"):
        plots.pick_layer({"runs": {}})


def test_histogram_choice_names_an_unknown_recipe_and_layer():
    report = {"runs": _runs(r1=[_input("a")]), "histograms": _hist("a")}
    with pytest.raises(ValueError, match=r"^plot: no run of recipe 'r9'; the report's recipes: "
                                         r"\['r1'\]$"):
        plots.histogram_choice(report, recipe="r9")
    with pytest.raises(ValueError, match=r"^plot: no input histogram for layer 'z'; layers "
                                         r"with one: \['a'\]$"):
        plots.histogram_choice(report, layer="z")


def test_a_layer_keep_float_took_out_is_said_so():
    report = {"runs": _runs(r1=[_input("a")]), "histograms": _hist("a")}
    report["runs"]["r1/minmax"]["info"] = {"keep_float": {"tensors": ["z input"]}}
    with pytest.raises(ValueError, match=r"for layer 'z' \(keep_float took it out of static "
                                         r"quantization: r1/minmax\); layers with one"):
        plots.histogram_choice(report, layer="z")


def _png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_save_figure_reads_the_extension_case_blind_and_defaults_to_png(tmp_path):
    pytest.importorskip("matplotlib")
    fig = plots.figure(figsize=(1, 1), dpi=20)
    for name in ("upper.PNG", "bare"):
        assert plots.save_figure(fig, str(tmp_path / name)) == str(tmp_path / name)
        assert _png(tmp_path / name)
    with pytest.raises(ValueError, match=r"its extension names no format matplotlib writes"):
        plots.save_figure(fig, str(tmp_path / "x.xyz"))
    assert sorted(os.listdir(tmp_path)) == ["bare", "upper.PNG"]


def test_sqnr_ticks_are_short_names_of_the_merged_layers(tmp_path, monkeypatch):
    """A layer one run lacks sits where the other run has it (before its next layer); BERT
    names are shortened (``L0.ffn.up``, ``L0.ffn.down``, ``L0.query``)."""
    pytest.importorskip("matplotlib")
    from test_plots_pins_s64 import _axes

    axes = _axes(monkeypatch)
    p = "encoder.layer.0."
    a, b, c = (p + "attention.self.query", p + "intermediate.dense", p + "output.dense")
    runs = {"r/minmax": {"recipe": "r", "observer": "minmax", "layers": [_input(a), _input(c)]},
            "r/mse": {"recipe": "r", "observer": "mse",
                      "layers": [_input(a), _input(b), _input(c)]}}
    plots.plot_sqnr({"runs": runs}, str(tmp_path / "s.png"))
    (ax,) = axes()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["L0.query", "L0.ffn.up",
                                                          "L0.ffn.down"]


def test_sqnr_ticks_label_every_layer_up_to_twenty_three(tmp_path, monkeypatch):
    """``step = max(1, len(layers) // 12)``: 20 layers, one tick each."""
    pytest.importorskip("matplotlib")
    from test_plots_pins_s64 import _axes

    axes = _axes(monkeypatch)
    plots.plot_sqnr({"runs": _runs(r=[_input(f"l{k}") for k in range(20)])},
                    str(tmp_path / "s.png"))
    (ax,) = axes()
    assert len(ax.get_xticks()) == 20


def test_a_missing_and_a_nan_sqnr_are_the_same_gap(tmp_path, monkeypatch):
    """Observers whose SQNR coincides on every layer share a line; None and NaN are one gap."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    labels = []
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: (
        labels.append(kw.get("label")), real(self, *a, **kw))[1])
    runs = {"r/minmax": {"recipe": "r", "observer": "minmax",
                         "layers": [_input("a", 20.0), _input("b", None)]},
            "r/mse": {"recipe": "r", "observer": "mse",
                      "layers": [_input("a", 20.0), _input("b", float("nan"))]}}
    plots.plot_sqnr({"runs": runs}, str(tmp_path / "s.png"))
    assert labels == ["minmax = mse"]


def test_sqnr_panels_fill_a_grid_of_ceil_rows_the_rest_blank(tmp_path, monkeypatch):
    """Three panels over two roles: two columns, two rows, the fourth axes turned off."""
    pytest.importorskip("matplotlib")
    from test_plots_pins_s64 import _axes

    axes = _axes(monkeypatch)
    weight = dict(_input("a"), role="weight")
    plots.plot_sqnr({"runs": _runs(r1=[weight, _input("a")], r2=[weight])},
                    str(tmp_path / "s.png"))
    got = axes()
    assert [ax.get_title() for ax in got] == ["r1 weight", "r1 input", "r2 weight", ""]
    assert not got[3].axison


def test_histogram_legend_and_limits(tmp_path, monkeypatch):
    """An ``auto`` run says which observer it chose; a ``"local"`` (calibrated) input's range
    is drawn; the x axis spans data and ranges with 3% margins."""
    pytest.importorskip("matplotlib")
    from test_plots_pins_s64 import _axes

    axes = _axes(monkeypatch)
    auto = dict(_input("l", dynamic="local"), requested="auto", observer="mse",
                clip_lo=-1.0, clip_hi=1.0)
    report = {"runs": {"nvfp4/auto": {"recipe": "nvfp4", "observer": "auto",
                                      "layers": [auto]}},
              "histograms": _hist("l")}
    plots.plot_histogram(report, "l", str(tmp_path / "h.png"))
    (ax,) = axes()
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
        "activations (sample)", "auto (chose mse): [-1, 1]"]
    assert ax.get_xlim() == pytest.approx((-2.12, 2.12))
