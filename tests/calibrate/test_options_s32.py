"""Options set in vain are refused or warned about; warnings point at the caller's line;
``Runtime.time_groups`` reaches ``observer="auto"`` recipes (issue s32)."""

from __future__ import annotations

import importlib
import pathlib
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import quantscope.calibration as qc
from quantscope.calibration import MoE, Runtime, Sampling
from quantscope.calibration.options import AUTO_METRICS, LOSS_METRICS, Auto
from quantscope.calibration.run import observe

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


def _mlp(seed=0, width=128):  # 128: w4a16's group size
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8)).eval()
    return model, [torch.randn(4, width) for _ in range(2)]


def _recorded(fn):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = fn()
    return out, got


# ---------------------------------------------------------------- time groups and auto
def test_time_groups_hold_auto_recipes_and_their_scoring(monkeypatch):
    """A group with an ``observer="auto"`` recipe (metric "model") is timed as the pass's
    shared time, every observer its recipes use once (auto's: all its candidates'), plus
    auto's scoring, as that recipe's own time is. A fake clock moves only in the naps of the
    mse observer and in the scoring's forwards, so the sums are exact."""
    from quantscope.calibration.choice.auto import OutputDivergence
    from quantscope.observers.registry import observer_class

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    for name in ("choice.auto", "run.finish", "run.observe", "choice.sensitivity", "run.session"):
        monkeypatch.setattr(importlib.import_module(f"quantscope.calibration.{name}"), "time",
                            clock)
    slow, naps, scored = observer_class("mse"), [], []
    real_forward, real_on = slow.forward, OutputDivergence.on

    def forward(self, x):
        naps.append(0.05)
        now[0] += 0.05
        return real_forward(self, x)

    def on(self, k):
        scored.append(1.0)
        now[0] += 1.0
        return real_on(self, k)

    monkeypatch.setattr(slow, "forward", forward)
    monkeypatch.setattr(OutputDivergence, "on", on)
    model, batches = _mlp()
    groups = {"with_auto": ["auto", "minmax"], "plain": ["minmax"]}
    cal = qc.calibrate_many(model, batches, {"minmax": qc.preset("w8a8", "minmax"),
                                             "auto": qc.preset("w8a8", "auto")},
                            auto=Auto(candidates=("minmax", "mse")),
                            runtime=Runtime(time_groups=groups), progress=False)
    slept, scoring = sum(naps), sum(scored)
    assert naps and scored
    assert cal["auto"].info["auto"]["score_seconds"] == pytest.approx(scoring)
    # auto's own time: its candidates' observers (the naps) and its scoring
    assert cal["auto"].info["calibration_seconds"] == pytest.approx(slept + scoring)
    assert cal["minmax"].info["calibration_seconds"] == 0.0
    for label in ("auto", "minmax"):  # min-max adds nothing auto's candidates do not have
        assert cal[label].info["group_seconds"]["with_auto"] == pytest.approx(slept + scoring)
    assert cal["minmax"].info["group_seconds"]["plain"] == 0.0
    assert "plain" not in cal["auto"].info["group_seconds"]


def test_time_groups_name_auto_labels_only_at_the_call():
    model, batches = _mlp()
    with pytest.raises(ValueError, match=r"time_groups\['g'\] names 'nope'"):
        qc.calibrate_many(model, batches, {"a": qc.preset("w8a8", "auto")},
                          runtime=Runtime(time_groups={"g": ["a", "nope"]}), progress=False)


# ---------------------------------------------------------------- Auto.score_tokens
@pytest.mark.parametrize("metric", [m for m in AUTO_METRICS if m not in LOSS_METRICS])
def test_score_tokens_is_refused_where_the_metric_reads_none(metric):
    with pytest.raises(ValueError, match=rf"score_tokens \(8192\).*metric={metric!r}"):
        Auto(metric=metric, score_tokens=8192)
    default = next(f.default for f in Auto.__dataclass_fields__.values()
                   if f.name == "score_tokens")
    assert Auto(metric=metric, score_tokens=default).score_tokens == default  # not set


@pytest.mark.parametrize("metric", LOSS_METRICS)
def test_score_tokens_is_taken_where_the_metric_reads_it(metric):
    assert Auto(metric=metric, score_tokens=8192).score_tokens == 8192


def test_sequential_auto_with_score_tokens_calibrates_its_replayed_head():
    """The head of a sequential calibration chooses per layer ("output"): the user's
    score_tokens, read by the blocks' metric "model", is not carried there."""
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                                        for _ in range(3))
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Blocks().eval()
    batches = [torch.randn(4, 16) for _ in range(2)]
    cal = qc.calibrate(model, batches, "w8a8", observer="auto", auto=Auto(score_tokens=4),
                       sequential=True, progress=False)
    assert sorted(cal.states) == ["head", "layers.0.0", "layers.1.0", "layers.2.0"]


# ---------------------------------------------------------------- MoE
def test_moe_refuses_min_tokens_with_all_experts():
    with pytest.raises(ValueError, match=r"MoE\.min_tokens \(10000\).*all_experts=True"):
        MoE(all_experts=True, min_tokens=10_000)
    default = MoE().min_tokens
    assert MoE(all_experts=True, min_tokens=default) == MoE(all_experts=True)
    assert MoE(min_tokens=10_000).min_tokens == 10_000  # routed mode reads it


# ---------------------------------------------------------------- Sampling
def test_sampling_on_a_weight_only_recipe_warns_at_the_caller():
    model, batches = _mlp()
    sampling = Sampling(tokens=7, seed=3, budget_mb=1)
    got, said = _recorded(lambda: qc.calibrate(model, batches, "w4a16", sampling=sampling,
                                               progress=False))
    hits = [w for w in said if "Sampling(" in str(w.message)]
    assert len(hits) == 1 and "weight-only" in str(hits[0].message)
    assert hits[0].filename == __file__
    ref = qc.calibrate(model, batches, "w4a16", progress=False)
    assert got.quantizes_like(ref) and got.stats == ref.stats  # it did change nothing


@pytest.mark.parametrize("recipe, sampling", [("w8a8", Sampling(tokens=7)),
                                              ("w4a16", Sampling()),
                                              ("w4a16", Sampling(seed=5))])  # the CLI's seed
def test_sampling_that_acts_or_is_not_set_says_nothing(recipe, sampling):
    model, batches = _mlp()
    _, said = _recorded(lambda: qc.calibrate(model, batches, recipe, sampling=sampling,
                                             progress=False))
    assert not [w for w in said if "Sampling(" in str(w.message)]


# ---------------------------------------------------------------- sensitivity
@pytest.mark.parametrize("given", [{"observer": "mse"},
                                   {"calib_batches": [torch.randn(4, 128)]},
                                   {"observer": "mse", "calib_batches": [torch.randn(4, 128)]}])
def test_sensitivity_refuses_calibration_options_with_a_calibration(given):
    model, batches = _mlp()
    c = qc.calibrate(model, batches, "w8a8", progress=False)
    with pytest.raises(ValueError, match=" and ".join(f"{k}=" for k in given)) as err:
        qc.sensitivity(model, batches, calibration=c, **given)
    assert "calibration=" in str(err.value)
    # without calibration= they say how it is calibrated: as calibrate() with them does
    s = qc.sensitivity(model, batches, **given)
    peer = qc.calibrate(model, given.get("calib_batches", batches), "w8a8",
                        observer=given.get("observer"), progress=False)
    assert s.rows == qc.sensitivity(model, batches, calibration=peer).rows


# ---------------------------------------------------------------- warning locations
def test_saw_no_tokens_and_unreached_warnings_point_at_the_caller():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.never = nn.Linear(16, 16), nn.Linear(16, 16)
            self.w = nn.Parameter(torch.randn(3, 16, 16))  # stacked: no expert module runs it

        def forward(self, x):
            return self.a(torch.einsum("bi,eoi->bo", x, self.w))

    torch.manual_seed(0)
    _, said = _recorded(lambda: qc.calibrate(Model().eval(), [torch.randn(2, 16)], "w8a8",
                                             progress=False))
    hits = {k: [w for w in said if k in str(w.message)] for k in ("saw no tokens", "cannot reach")}
    assert all(len(v) == 1 for v in hits.values()), said
    assert {w.filename for v in hits.values() for w in v} == {__file__}


# ---------------------------------------------------------------- progress without tqdm
def _tqdm_extra() -> str:
    """The extra of pyproject.toml that installs tqdm."""
    root = pathlib.Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    return next(name for name, deps in extras.items() if "tqdm" in deps)


def test_progress_without_tqdm_warns_once_at_the_caller(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    observe._no_tqdm.cache_clear()
    try:
        model, batches = _mlp()
        _, said = _recorded(lambda: [qc.calibrate(model, batches, "w8a8", progress=True)
                                     for _ in range(2)])
        c = qc.calibrate(model, batches, "w8a8", progress=False)
        _, also = _recorded(lambda: [qc.sensitivity(model, batches, calibration=c,
                                                    progress=True) for _ in range(2)])
    finally:
        observe._no_tqdm.cache_clear()
    for who, got in (("calibrate", said), ("sensitivity", also)):
        hits = [w for w in got if "tqdm" in str(w.message)]
        assert len(hits) == 1, (who, got)  # once, not once a call
        message = str(hits[0].message)
        assert message.startswith(f"{who}:") and "pip install tqdm" in message
        assert f"quantscope[{_tqdm_extra()}]" in message
        assert hits[0].filename == __file__


def test_progress_bar_wraps_the_items_once_tqdm_is_there():
    pytest.importorskip("tqdm")
    items = [1, 2, 3]
    assert observe.with_progress(items, False, "calibrate") is items
    bar = observe.with_progress(items, True, "calibrate", total=3, disable=True)
    assert list(bar) == items and bar.total == 3
