"""Reports, plots and sensitivity, as a probe of them found wanting: the KV cache listed, a
run-time role's observer part of what it computes, SQNR summed in float64, report files
written atomically, NaN held-out batches named, a loaded calibration's report saying why it
has no rows, and plots that refuse what they cannot draw."""

import json
import math
import os

import pytest
import torch
from torch import nn

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule
from quantscope.calibration.choice.sensitivity import layer_sensitivity
from quantscope.calibration.results import plots
from quantscope.calibration.results.apply import qdq_tensor


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()


def _batches():
    torch.manual_seed(1)
    return [torch.randn(8, 32) for _ in range(2)]


# ------------------------------------------------------------------ KV cache in the report

def test_a_kv_cache_only_report_lists_its_tensors():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100)).eval()
    batches = [torch.randint(0, 100, (2, 8)) for _ in range(2)]
    c = quantscope.calibrate(model, batches, Recipe((), kv_cache="fp8"), progress=False)
    report = c.report()
    assert {(r["layer"], r["role"]) for r in report.kv_cache} == {
        ("model.layers.0.self_attn", "key"), ("model.layers.0.self_attn", "value")}
    for r in report.kv_cache:
        st = c.states[r["layer"]][r["role"]]
        assert r["scale_min"] == pytest.approx(float(st.qparams.scale.min()))
        assert r["lo"] == pytest.approx(float(st.lo.min()))
        assert r["hi"] == pytest.approx(float(st.hi.max()))
        assert r["spec"] == str(st.spec)
    assert "## KV cache" in report.to_markdown()
    assert json.loads(report.to_json())["kv_cache"][0]["role"] in ("key", "value")
    assert report.notes == []  # no layer rows, but none missing: the cache is never sampled


# ------------------------------------------------------------------ quantizes_like (dynamic)

def test_quantizes_like_compares_a_run_time_roles_observer_and_options():
    m, bs = _mlp(), _batches()

    def calib(obs, options=None):
        r = Recipe((Rule(("Linear",), weight=Role(QuantSpec("int8", "channel"), "minmax"),
                         input=Role(QuantSpec("int4", "token"), obs, dynamic=True,
                                    options=options or {})),), name=obs)
        return quantscope.calibrate(m, bs, r, progress=False)

    a, b = calib("memoryless_minmax"), calib("memoryless_mse")
    assert not a.quantizes_like(b) and not b.quantizes_like(a)
    assert a.quantizes_like(calib("memoryless_minmax"))
    st = a.states["0"]["input"]
    other = type(st)(**{**st.__dict__, "options": (("non_finite", "ignore"),)})
    assert not st.quantizes_like(other)
    # a static role's observer is only how its qparams were found: it does not count
    w = a.states["0"]["weight"]
    assert w.quantizes_like(type(w)(**{**w.__dict__, "observer": "other"}))


# ------------------------------------------------------------------ SQNR in float64

@pytest.mark.parametrize("mag", [1e18, 1e20])
def test_sqnr_of_large_finite_weights_is_summed_in_float64(mag):
    m = nn.Sequential(nn.Linear(64, 64, bias=False)).eval()
    with torch.no_grad():
        m[0].weight.mul_(mag / m[0].weight.abs().max())
    c = quantscope.calibrate(m, [torch.randn(4, 64)], "fp8-dynamic", progress=False)
    row = next(r for r in c.report().rows if r["role"] == "weight")
    w = m[0].weight.double()
    q = qdq_tensor(m[0].weight, c.states["0"]["weight"]).double()
    want = 10 * math.log10(float(w.square().sum()) / float((w - q).square().sum()))
    assert row["sqnr_db"] == pytest.approx(want, rel=1e-9)


def test_square_sum_by_chunks_is_the_whole_sum(monkeypatch):
    from quantscope.calibration.results import report

    x = torch.randn(1000)
    monkeypatch.setattr(report, "_CHUNK", 7)
    assert float(report._square_sum(x)) == pytest.approx(float(x.double().square().sum()))


# ------------------------------------------------------------------ atomic report files

@pytest.mark.parametrize("write", ["to_json", "to_markdown"])
def test_report_files_replace_a_symlink_never_write_through_it(tmp_path, write):
    c = quantscope.calibrate(_mlp(), _batches(), "w8a8", progress=False)
    precious = tmp_path / "config.json"
    precious.write_text('{"keep": 1}')
    link = tmp_path / "report.out"
    os.symlink(precious, link)
    text = getattr(c.report(), write)(str(link))
    assert precious.read_text() == '{"keep": 1}'
    assert not link.is_symlink() and link.read_text().startswith(text)


# ------------------------------------------------------------------ NaN held-out batches

def _nan_batches():
    bs = [b.clone() for b in _batches()]
    bs[1][0, 0] = float("nan")
    return bs


def test_layer_sensitivity_names_the_nan_batch():
    m = _mlp()
    c = quantscope.calibrate(m, _batches(), "w8a8", progress=False)
    with pytest.raises(ValueError, match=r"layer_sensitivity: layer '0': batch 1 \(counting "
                                         r"from 0\) brought NaN or inf"):
        layer_sensitivity(m, _nan_batches(), c)
    # the hooks went with the error
    assert not m[0]._forward_pre_hooks and not m[2]._forward_pre_hooks


def test_sensitivity_names_itself_and_the_nan_batch():
    m = _mlp()
    c = quantscope.calibrate(m, _batches(), "w8a8", progress=False)
    with pytest.raises(ValueError, match=r"^sensitivity: batch 1 \(counting from 0\) brought "
                                         r"NaN or inf") as e:
        quantscope.calibrate.sensitivity(m, _nan_batches(), calibration=c)
    assert "auto" not in str(e.value)


# ------------------------------------------------------------------ loaded calibration

def test_a_loaded_calibrations_report_says_it_has_no_statistics(tmp_path):
    c = quantscope.calibrate(_mlp(), _batches(), "w8a8", progress=False)
    assert c.report().notes == []
    c.save(tmp_path / "c")
    back = quantscope.calibrate.load(tmp_path / "c")
    report = back.report()
    assert report.rows == [] and len(report.notes) == 1
    assert "not keep" in report.notes[0] and "Note: no layer statistics" in \
        report.to_markdown()
    assert report.to_dict()["notes"] == report.notes


# ------------------------------------------------------------------ plots

def _report(runs, histograms=None):
    return {"runs": runs, "histograms": histograms or {}}


def _row(layer, sqnr):
    return {"layer": layer, "role": "input", "sqnr_db": sqnr, "dynamic": False}


def test_plot_sqnr_refuses_a_report_without_layer_rows(tmp_path):
    report = _report({"w8a8/minmax": {"recipe": "w8a8", "observer": "minmax", "layers": []}})
    with pytest.raises(ValueError, match="no run of the report has a layer row"):
        plots.plot_sqnr(report, str(tmp_path / "sqnr.png"))
    assert not (tmp_path / "sqnr.png").exists()


def test_pick_layer_picks_among_layers_with_a_histogram():
    runs = {f"fp8/{o}": {"recipe": "fp8", "observer": o,
                         "layers": [_row("a", s), _row("b", 2 * s)]} for o, s in
            (("minmax", 10.0), ("mse", 20.0))}
    hist = {"lo": 0.0, "hi": 1.0, "counts": [1]}
    assert plots.pick_layer(_report(runs, {"a/input": hist, "b/input": hist})) == "b"
    assert plots.pick_layer(_report(runs, {"a/input": hist})) == "a"
    assert plots.pick_layer(_report(runs)) is None
