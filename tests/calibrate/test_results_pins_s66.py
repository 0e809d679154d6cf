"""Pins from the s66 mutation round over ``calibration/results`` (the report's rows, numbers
and tables; save / load; apply) and ``integrations/torchao``: behaviour no earlier test
held, each expected value taken from the definition a docstring or the module's own docs
give (the SQNR formula, the summary's means, the JSON / markdown forms), never from a run."""

import math
import warnings

import pytest
import torch
from saved_edits import edit_saved
from test_results_pins_s63 import _saved
from test_results_s32 import _saved as _saved_net
from torch import nn

from quantscope import QuantSpec, qparams_from_range
from quantscope.calibration import Recipe, Role, Rule, calibrate
from quantscope.calibration.results.apply import apply
from quantscope.calibration.results.io import load
from quantscope.calibration.results.report import (
    Report,
    exact_note,
    format_table,
    json_safe,
    json_text,
    kv_cache_rows,
    markdown_table,
    sqnr_db,
    summarize,
    tensor_stats,
)
from quantscope.calibration.results.role_state import RoleState
from quantscope.layout import Channel, Tensor


def _state(spec, lo, hi):
    qp = qparams_from_range(torch.tensor(lo), torch.tensor(hi), spec)
    return RoleState(spec, "minmax", "minmax", qparams=qp,
                     lo=torch.tensor(lo), hi=torch.tensor(hi))


def test_sqnr_db_is_ten_log10_of_signal_over_noise_and_inf_without_noise():
    """``10 log10(signal / noise)`` in dB (a power ratio: 100 is 20 dB, not 40); no error at
    all is inf, an all-zero signal with error -inf."""
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0)
    assert sqnr_db(4.0, 0.0) == math.inf
    assert sqnr_db(0.0, 1.0) == -math.inf


def test_tensor_stats_clipped_fraction_is_over_all_elements():
    """``clipped``: the fraction of the tensor's values whose code falls outside the range:
    one value of four past ``qmax * scale`` is 0.25."""
    spec = QuantSpec("int8", Tensor())
    st = _state(spec, [-1.0], [1.0])
    x = torch.tensor([0.5, -0.5, 3.0, 0.25])
    out = tensor_stats(x, st)
    assert out["clipped"] == 0.25
    assert out["numel"] == 4 and out["units"] == 1
    assert out["min"] == -0.5 and out["max"] == 3.0


def test_tensor_stats_clip_range_spans_every_units_edges():
    """``clip_lo`` / ``clip_hi``: the smallest and the largest values the quantizer
    represents over all units, ``(qmin - z) * s`` of the unit with the widest low edge and
    ``(qmax - z) * s`` of the widest high one."""
    spec = QuantSpec("int8", Channel(0))
    st = _state(spec, [-1.0, -2.0], [1.0, 2.0])
    s = st.qparams.scale.double().flatten()
    z = st.qparams.zero_point.double().flatten()
    out = tensor_stats(torch.tensor([[0.5, -0.5], [1.0, -1.5]]), st)
    assert out["clip_lo"] == pytest.approx(float(((spec.qmin - z) * s).min()))
    assert out["clip_hi"] == pytest.approx(float(((spec.qmax - z) * s).max()))
    assert out["clip_lo"] < float(((spec.qmin - z) * s).max())


def _row(layer, role, sqnr, clipped=0.0, observer="minmax"):
    return {"layer": layer, "role": role, "observer": observer, "sqnr_db": sqnr,
            "clipped": clipped, "lo": -1.0, "hi": 1.0, "units": 4}


def test_summarize_means_and_worst_layer_are_per_role():
    """Per role: the mean clipped fraction over that role's layers (not all rows), the
    minimum SQNR and the layer holding it, and the mean over the finite SQNRs."""
    rows = [_row("a", "weight", 30.0, 0.1), _row("b", "weight", 10.0, 0.3, "mse"),
            _row("c", "input", math.inf), _row("d", "input", 20.0, 0.5)]
    s = summarize(rows)
    w = s["weight"]
    assert w["layers"] == 2 and w["mean_sqnr_db"] == pytest.approx(20.0)
    assert w["min_sqnr_db"] == 10.0 and w["worst_layer"] == "b"
    assert w["mean_clipped"] == pytest.approx(0.2)
    assert w["observers"] == {"minmax": 1, "mse": 1}
    i = s["input"]
    assert i["mean_sqnr_db"] == pytest.approx(20.0) and i["exact_layers"] == 1
    assert i["worst_layer"] == "d" and i["mean_clipped"] == pytest.approx(0.25)


def test_summarize_a_role_with_only_exact_rows_has_mean_sqnr_inf():
    """A role all of whose tensors QDQ leaves unchanged has no finite SQNR to average: its
    mean is inf (no error), as its minimum."""
    s = summarize([_row("a", "weight", math.inf), _row("b", "weight", math.inf)])
    assert s["weight"]["mean_sqnr_db"] == math.inf
    assert s["weight"]["min_sqnr_db"] == math.inf
    assert s["weight"]["exact_layers"] == 2


def test_only_an_infinite_positive_sqnr_counts_as_exact():
    """Exact (no quantization error) is SQNR +inf; -inf (an all-zero signal with error) is
    the opposite: not counted, not in the note, ``sqnr_exact`` false."""
    rows = [_row("a", "weight", -math.inf), _row("b", "weight", math.inf)]
    assert summarize(rows)["weight"]["exact_layers"] == 1
    note = exact_note(rows)
    assert "b weight" in note and "a weight" not in note
    layers = Report("l", "r", rows).to_dict()["layers"]
    assert [r["sqnr_exact"] for r in layers] == [False, True]


def test_exact_note_lists_eight_rows_and_counts_only_past_eight():
    """The note names up to eight rows; only past eight does it add ``... (N in all)``."""
    eight = [_row(f"l{k}", "weight", math.inf) for k in range(8)]
    note = exact_note(eight)
    assert "in all" not in note
    assert all(f"l{k} weight" in note for k in range(8))
    note = exact_note([*eight, _row("l8", "weight", math.inf)])
    assert note.endswith("l7 weight ... (9 in all)")
    assert "l8 weight" not in note


def test_table_numbers_switch_to_exponent_below_a_hundredth_and_from_a_million():
    """Two decimals, or exponent form where that would hide the value: below 10**-2 in
    magnitude, or at 1e6 and above."""
    text = format_table(["v"], [[1e6], [999999.0], [0.005], [0.01], [0.0]])
    cells = [line.strip() for line in text.splitlines()[2:]]
    assert cells == ["1.00e+06", "999999.00", "5.00e-03", "0.01", "0.00"]


def test_json_safe_walks_tuples_too():
    """Non-finite floats become None inside tuples as inside lists (strict JSON)."""
    assert json_safe({"a": (1.0, math.nan, -math.inf)}) == {"a": [1.0, None, None]}
    assert json_text({"a": (math.inf,)}) == '{"a": [null]}'


def test_markdown_cells_escape_carriage_returns():
    """A name's ``\\r`` is written as ``\\r`` in its cell: raw, it would break the row."""
    text = markdown_table(["layer"], [["a\rb|c"]])
    assert text.splitlines()[2] == "| a\\rb\\|c |"
    assert "\r" not in text


def test_markdown_clipped_columns_are_percent():
    """The layer table's and the summary's ``clipped %`` are 100 x the clipped fraction."""
    rows = [_row("a", "weight", 30.0, 0.25)]
    text = Report("lbl", "w8a8", rows).to_markdown()
    assert "| a | weight | minmax | 30.00 | 25.00 | -1.00 | 1.00 | 4 |" in text
    assert "| weight | 1 | 30.00 | 30.00 | a | 25.00 | minmax 1 |" in text


def test_kv_cache_rows_give_the_whole_range_and_one_scale_when_all_equal():
    """A KV-cache row's range is its lowest ``lo`` and highest ``hi`` over units; the table's
    scale cell shows one value where min and max agree, ``min .. max`` otherwise."""
    spec = QuantSpec("int8", Channel(0))
    one = _state(QuantSpec("int8", Tensor()), [-0.5], [0.5])
    two = _state(spec, [-2.0, -1.0], [1.0, 3.0])
    rows = kv_cache_rows({"attn": {"key": one, "value": two, "input": one}})
    assert [r["role"] for r in rows] == ["key", "value"]
    assert rows[1]["lo"] == -2.0 and rows[1]["hi"] == 3.0
    s1 = f"{float(one.qparams.scale.flatten()[0]):.4g}"
    s2 = two.qparams.scale.flatten().tolist()
    text = Report("l", "r", [], kv_cache=rows).to_markdown()
    assert f"| attn | key | {one.spec} | minmax | {s1} | -0.50 | 0.50 |" in text
    assert f"| {min(s2):.4g} .. {max(s2):.4g} | -2.00 | 3.00 |" in text


def test_report_json_is_indented_by_one():
    """``to_json``: the dict as JSON text with indent 1."""
    text = Report("lbl", "w8a8", [_row("a", "weight", 30.0)]).to_json()
    assert text.startswith('{\n "label": "lbl",\n "recipe": "w8a8",\n')


def test_fallback_table_says_dynamic_keep_float_runs_on_per_call_scales():
    """The Fallback (keep_float) table tells a dynamic fallback by its scales, from each
    call, and a float one as float."""
    for mode, runs in (("dynamic", "dynamic (scales from each call)"), ("float", "float")):
        info = {"keep_float": {"mode": mode, "tensors": ["fc1 input"]}}
        text = Report("l", "r", [_row("a", "weight", 30.0)], info=info).to_markdown()
        assert f"| fc1 input | {runs} |" in text


def _nvfp4_saved(tmp_path):
    """An NVFP4 calibration (static weights with a global scale, ``"local"`` inputs) of a
    small MLP, saved to ``tmp_path / "calib"``: its path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    return calibrate(model, [torch.randn(4, 32)], "nvfp4", progress=False).save(
        tmp_path / "calib")


def test_load_refuses_a_boolean_version(tmp_path):
    """``version`` is an int of READS: JSON ``true`` equals 1 in Python but is no version."""
    path = _saved(tmp_path)
    edit_saved(path, meta=lambda d: d.update(version=True))
    with pytest.raises(ValueError, match=r"quantscope\.json: version: .*got True"):
        load(path)


def test_load_refuses_a_fingerprint_on_a_run_time_role(tmp_path):
    """Only a calibrated (static or ``"local"``) role records a fingerprint: a run-time one
    (``dynamic: true``) holding one is an edit, refused naming the key."""
    path = _saved(tmp_path)

    def dynamic_input(d):
        d["layers"]["0"]["input"]["dynamic"] = True

    edit_saved(path, meta=dynamic_input)
    with pytest.raises(ValueError, match=r"layers\.0\.input\.fingerprint: only a calibrated"):
        load(path)


def test_load_takes_a_per_tensor_scale_stored_as_a_scalar(tmp_path):
    """A per-tensor role has one scale, stored as ``(1,)`` or as a scalar: both load."""
    path = _saved(tmp_path)

    def scalars(tensors):
        for field in ("scale", "zero_point"):
            tensors[f"0/input/{field}"] = tensors[f"0/input/{field}"].reshape(())

    edit_saved(path, tensors=scalars)
    assert load(path).states["0"]["input"].qparams.scale.numel() == 1


@pytest.mark.parametrize("scale", [[1.0, 0.0], [1.0, math.inf], []])
def test_load_refuses_a_smoothing_scale_of_zero_inf_or_no_channel(tmp_path, scale):
    """A SmoothQuant scale divides the weights: one finite value > 0 per channel, at least
    one channel."""
    path = _saved(tmp_path)
    edit_saved(path, tensors=lambda t: t.update({"#smooth/0": torch.tensor(scale)}))
    with pytest.raises(ValueError, match=r"#smooth/0: (must be finite and > 0|expected a 1-D)"):
        load(path)


def test_load_takes_a_smoothing_scale_of_positive_channels(tmp_path):
    """The ``#smooth/`` keys no role reads load as ``smoothing``, by module name."""
    path = _saved(tmp_path)
    edit_saved(path, tensors=lambda t: t.update({"#smooth/0": torch.full((8,), 0.5)}))
    assert torch.equal(load(path).smoothing["0"], torch.full((8,), 0.5))


def test_load_refuses_the_meta_device():
    """``device="meta"`` holds no values for load to check: refused before any file is read."""
    with pytest.raises(ValueError, match="device 'meta' holds no values"):
        load("no-such-folder", device="meta")


def test_load_takes_a_local_roles_global_amax_of_zero(tmp_path):
    """A ``"local"`` role's whole-tensor amax is ``>= 0`` (an all-zero input's is 0): zero
    loads, a negative one is refused."""
    path = _nvfp4_saved(tmp_path)
    edit_saved(path, tensors=lambda t: t["0/input/global_amax"].zero_())
    assert float(load(path).states["0"]["input"].global_amax) == 0.0
    edit_saved(path, tensors=lambda t: t["0/input/global_amax"].fill_(-1.0))
    with pytest.raises(ValueError, match=r"0/input/global_amax: must be >= 0"):
        load(path)


def test_load_refuses_a_global_scale_of_two_values(tmp_path):
    """NVFP4's weight has one global scale: two values (an edit) are refused."""
    path = _nvfp4_saved(tmp_path)

    def two(tensors):
        tensors["0/weight/global_scale"] = tensors["0/weight/global_scale"].reshape(1).repeat(2)

    edit_saved(path, tensors=two)
    with pytest.raises(ValueError, match=r"0/weight/global_scale: expected one value, got 2"):
        load(path)


class _Add(nn.Module):
    """``x + y``: a module of two tensor arguments, the first its input."""

    def forward(self, x, y):
        return x + y


def _input_state():
    spec = QuantSpec("int8", Tensor())
    return RoleState(spec, "minmax", "minmax",
                     qparams=qparams_from_range(torch.tensor([-1.0]), torch.tensor([1.0]), spec))


def _qdq(x, state):
    """``(clamp(round(x / s) + z, qmin, qmax) - z) * s``: fake quantization by definition."""
    s, z, spec = state.qparams.scale, state.qparams.zero_point.float(), state.spec
    return (((x / s).round() + z).clamp(spec.qmin, spec.qmax) - z) * s


def test_an_input_role_quantizes_the_first_argument_and_passes_the_rest():
    """The input hook fake-quantizes the module's first argument only, positional or
    keyword, and hands every other argument through unchanged."""
    model, st = nn.Sequential(_Add()), _input_state()
    x, y = torch.tensor([0.3, -2.0, 0.011]), torch.tensor([0.0123, 0.5, 3.0])
    with apply(model, {"0": {"input": st}}):
        positional = model[0](x, y)
        keyword = model[0](x=x, y=y)
        mixed = model[0](x, y=y)
    want = _qdq(x, st) + y
    assert torch.equal(positional, want)
    assert torch.equal(keyword, want)
    assert torch.equal(mixed, want)


def test_apply_refuses_an_unknown_role_and_leaves_the_model_float():
    """A role apply does not know is refused naming it and the layer; nothing stays applied
    (a later apply of valid states goes through)."""
    model = nn.Sequential(nn.Linear(4, 4))
    w = model[0].weight.detach().clone()
    states = {"0": {"weight": _state_for_weight(model[0].weight), "bogus": _input_state()}}
    with pytest.raises(ValueError, match=r"unknown role 'bogus' for '0'"):
        apply(model, states)
    assert torch.equal(model[0].weight, w)
    apply(model, {"0": {"input": _input_state()}}).remove()


def _state_for_weight(w):
    spec = QuantSpec("int8", Tensor())
    amax = w.detach().abs().max().reshape(1)
    return RoleState(spec, "minmax", "minmax", qparams=qparams_from_range(-amax, amax, spec),
                     shape=tuple(w.shape))


def test_apply_refuses_a_model_already_applied():
    """A second apply() on an applied model is refused until the first handle is removed."""
    model = nn.Sequential(nn.Linear(4, 4))
    handle = apply(model, {"0": {"input": _input_state()}})
    with pytest.raises(ValueError, match="already has quantscope QDQ applied"):
        apply(model, {"0": {"input": _input_state()}})
    handle.remove()
    apply(model, {"0": {"input": _input_state()}}).remove()


def test_tied_weight_warning_names_only_the_holders_without_a_state():
    """Layers sharing one weight that all have states raise no warning; one without a state
    is named (it runs the weight fake-quantized too)."""
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False),
                          nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    model[2].weight = model[0].weight
    st = _state_for_weight(model[0].weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply(model, {str(k): {"weight": st} for k in range(3)}).remove()
    with pytest.warns(UserWarning, match=r"0\.weight is also the weight of \['2'\]"):
        apply(model, {"0": {"weight": st}, "1": {"weight": st}}).remove()


def test_load_takes_zero_points_at_either_end_of_the_code_range(tmp_path):
    """An asymmetric spec's zero point lies in ``[qmin, qmax]``, both ends included (a range
    all above zero puts it at qmin, all below at qmax); one past either end is refused."""
    spec = QuantSpec("int8", Tensor(), symmetric=False)
    recipe = Recipe([Rule(("Linear",), input=Role(spec, "minmax"))], name="asym")
    *_, path = _saved_net(tmp_path, recipe)
    for zp in (spec.qmin, spec.qmax):
        edit_saved(path, tensors=lambda t, zp=zp: t["proj/input/zero_point"].fill_(zp))
        assert int(load(path).states["proj"]["input"].qparams.zero_point) == zp
    for zp in (spec.qmin - 1, spec.qmax + 1):
        edit_saved(path, tensors=lambda t, zp=zp: t["proj/input/zero_point"].fill_(zp))
        with pytest.raises(ValueError, match=r"proj/input/zero_point: outside the code range"):
            load(path)


@pytest.mark.parametrize("shape", [[0, 8], [4, 0]])
def test_load_takes_a_recorded_shape_with_a_zero_size(tmp_path, shape):
    """A role's ``shape`` is null or a list of sizes, each ``>= 0``: an empty dimension is a
    size; a negative one is refused."""
    path = _saved(tmp_path)

    def set_shape(d, shape=shape):
        d["layers"]["0"]["input"]["shape"] = shape

    edit_saved(path, meta=set_shape)
    assert load(path).states["0"]["input"].shape == tuple(shape)
    edit_saved(path, meta=lambda d: set_shape(d, [-1, 8]))
    with pytest.raises(ValueError, match=r"layers\.0\.input\.shape: expected null or a list"):
        load(path)


def test_an_output_role_passes_the_straight_through_gradient():
    """An output role's QDQ passes the straight-through gradient (inside its range: the
    identity's) to the layer and the input, as an input role's does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    spec = QuantSpec("int8", Tensor())
    qp = qparams_from_range(torch.tensor([-100.0]), torch.tensor([100.0]), spec)
    x = torch.randn(2, 4, requires_grad=True)
    with apply(model, {"0": {"output": RoleState(spec, "minmax", "minmax", qparams=qp)}}):
        model(x).sum().backward()
    assert torch.allclose(x.grad, model[0].weight.detach().sum(0).expand(2, 4))
    assert torch.allclose(model[0].bias.grad, torch.full((3,), 2.0))
