"""Pins of the calibration option objects (quantscope.calibration.options) that a mutation
round (session 66) found unpinned: the documented defaults of each object, the bounds of the
budgets, the fields whose errors name them (and their old keyword), the object-level
conflicts (``MoE.min_tokens`` with ``all_experts``, ``Outliers.fallback``), ``Options.but``
applying an object's fields together, each flat keyword setting its own field (a field
equal to its default counting as not set), ``as_sequential``'s shorthands, ``check_here``'s
folder and ``check_device``'s answers about the devices this torch sees."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope.calibration import Auto, MoE, Outliers, Runtime, Sampling, Sequential
from quantscope.calibration.options import (
    Options,
    as_sequential,
    check_device,
    from_keywords,
)
from quantscope.calibration.structure.moe import MIN_TOKENS


def test_defaults_are_the_documented_ones():
    """--sample-tokens 2048 and --seed 0 (command-line guide), score_tokens=1024 and metric
    "model" (choosing guide), missing "skip" (calibrating guide), fallback "dynamic",
    ``sequential=True`` is ``Sequential()`` in mode "float", progress on."""
    s = Sampling()
    assert (s.tokens, s.budget_mb, s.seed) == (2048, None, 0)
    a = Auto()
    assert (a.candidates, a.metric, a.loss, a.score_tokens) == (None, "model", None, 1024)
    m = MoE()
    assert m.all_experts is False and m.min_tokens == MIN_TOKENS  # the moe module's threshold
    o = Outliers()
    assert (o.smooth, o.keep_float, o.fallback) == (None, 0, "dynamic")
    seq = Sequential()
    assert seq.mode == "float" and as_sequential(True).mode == "float"
    r = Runtime()
    assert (r.distributed, r.group, r.missing, r.time_groups) == (False, None, "skip", None)
    opts = Options()
    assert opts.progress is True and opts.sequential is None


@pytest.mark.parametrize("mb", [0, 0.0, math.inf])
def test_sampling_budget_must_be_a_positive_finite_number(mb):
    with pytest.raises(ValueError, match=r"Sampling\.budget_mb \(sample_budget_mb\) must be "
                                         r"a positive number of MB"):
        Sampling(budget_mb=mb)


def test_sequential_cache_budget_of_zero_is_taken():
    """``>= 0``: 0 spills every cached activation to disk."""
    assert Sequential(cache_budget_mb=0).cache_budget_mb == 0


@pytest.mark.parametrize("name", ["minmax", "mse"])
def test_a_string_of_candidates_is_refused_not_read_as_its_letters(name):
    with pytest.raises(ValueError, match=rf"Auto\.candidates must be a list of observer "
                                         rf"names, got '{name}'"):
        Auto(candidates=name)


def test_empty_candidates_do_not_speak_of_auto():
    """"but for 'auto' itself" only where 'auto' was named."""
    with pytest.raises(ValueError, match=r"Auto\.candidates is empty; give at least one "
                                         r"observer name"):
        Auto(candidates=[])


def test_moe_min_tokens_error_names_its_old_keyword():
    with pytest.raises(ValueError, match=r"MoE\.min_tokens \(expert_min_tokens\) must be a "
                                         r"positive integer, got 0"):
        MoE(min_tokens=0)


@pytest.mark.parametrize("n", [1, MIN_TOKENS - 1, MIN_TOKENS + 1])
def test_moe_all_experts_refuses_any_min_tokens_set(n):
    """Below the default as above it: routed mode alone reads it."""
    with pytest.raises(ValueError, match=rf"MoE\.min_tokens \({n}\) .*all_experts=True"):
        MoE(all_experts=True, min_tokens=n)


def test_outliers_smooth_error_names_the_field():
    with pytest.raises(ValueError, match=r"^calibrate: Outliers\.smooth: alpha must be a "
                                         r"number in \[0, 1\]"):
        Outliers(smooth=1.5)


def test_a_file_is_not_a_cache_dir(tmp_path):
    """``check_here`` wants an existing folder: a file there is refused, a folder taken."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"Sequential\.cache_dir .* is not an existing "
                                         r"folder"):
        Sequential(cache_dir=f).check_here()
    Sequential(cache_dir=tmp_path).check_here()


def test_sequential_keywords_are_every_field():
    """What the session passes to calibrate_sequential: all six fields, as set."""
    seq = Sequential("quantized", "ckpt", "model.layers", 2, "spill", "cpu")
    assert seq.keywords() == {"mode": "quantized", "checkpoint": "ckpt",
                              "blocks": "model.layers", "cache_budget_mb": 2,
                              "cache_dir": "spill", "device": torch.device("cpu")}


@pytest.mark.parametrize("labels", [{"a", "b"}, frozenset({"a", "b"})])
def test_time_groups_take_a_set_of_labels(labels):
    got = Runtime(time_groups={"g": labels}).time_groups
    assert set(got) == {"g"} and isinstance(got["g"], tuple)
    assert sorted(got["g"]) == ["a", "b"]


@pytest.mark.parametrize("name", ["sampling", "auto", "moe", "outliers", "runtime"])
def test_options_take_none_only_for_sequential(name):
    """None means "off" for sequential alone; the other objects must be there."""
    with pytest.raises(TypeError, match=rf"{name} must be \w+\(\.\.\.\), got NoneType"):
        Options(**{name: None})


def test_but_applies_an_objects_fields_together():
    """Checked against each other once all are set, whatever their order."""
    o = Options().but(outliers__fallback="float", outliers__keep_float=1)
    assert o.outliers == Outliers(keep_float=1, fallback="float")
    o = Options().but(moe__min_tokens=MIN_TOKENS, moe__all_experts=True)
    assert o.moe == MoE(all_experts=True)


@pytest.mark.parametrize(("keyword", "value", "kind", "name"), [
    ("sample_tokens", 7, "sampling", "tokens"),
    ("sample_budget_mb", 3.0, "sampling", "budget_mb"),
    ("seed", 5, "sampling", "seed"),
    ("candidates", ("mse",), "auto", "candidates"),
    ("auto_metric", "fisher", "auto", "metric"),
    ("score_tokens", 64, "auto", "score_tokens"),
    ("all_experts", True, "moe", "all_experts"),
    ("expert_min_tokens", 9, "moe", "min_tokens"),
    ("smooth", 0.5, "outliers", "smooth"),
    ("keep_float", 2, "outliers", "keep_float"),
    ("blocks", "model.layers", "sequential", "blocks"),
    ("cache_budget_mb", 4.0, "sequential", "cache_budget_mb"),
    ("cache_dir", "spill", "sequential", "cache_dir"),
    ("missing", "float", "runtime", "missing"),
])
def test_each_flat_keyword_sets_the_field_it_became(keyword, value, kind, name):
    """The objects' docstrings: ``tokens`` was ``sample_tokens=`` and so on; nothing else
    changes."""
    base = Options(sequential=Sequential())
    with pytest.warns(DeprecationWarning, match=rf"{keyword}= -> "):
        got = from_keywords(base, {keyword: value})
    assert getattr(getattr(got, kind), name) == value
    assert got == base.but(**{f"{kind}__{name}": value})


def test_a_keyword_that_was_never_flat_is_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'min_tokens'"):
        from_keywords(Options(), {"min_tokens": 3})


def test_a_field_equal_to_its_default_counts_as_not_set():
    """Equal, not only the same object: an int computed at run time is its default too."""
    tokens, score = int("2048"), int("1024")  # equal to the defaults, other objects
    opts = Options(sampling=Sampling(tokens=tokens), auto=Auto(score_tokens=score))
    with pytest.warns(DeprecationWarning):
        got = from_keywords(opts, {"sample_tokens": 7, "score_tokens": 64})
    assert (got.sampling.tokens, got.auto.score_tokens) == (7, 64)


@pytest.mark.parametrize("value", [0, 1, "", "True"])
def test_sequential_shorthand_is_exactly_true_false_or_a_mode(value):
    """``True`` / ``"float"`` / ``"quantized"``, ``None`` / ``False``: not what equals them."""
    with pytest.raises(ValueError, match="sequential must be True or one of"):
        as_sequential(value)


def _cuda(monkeypatch, available: bool, count: int, built=None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.version, "cuda", built)


@pytest.mark.parametrize(("count", "devices"), [(2, "2 cuda devices"), (1, "1 cuda device")])
def test_a_device_index_equal_to_the_count_is_refused(monkeypatch, count, devices):
    """No index and the last one are taken, the count refused; one device is named in the
    singular."""
    _cuda(monkeypatch, True, count, "12.4")
    check_device(torch.device("cuda"), "who")
    check_device(torch.device(f"cuda:{count - 1}"), "who")
    with pytest.raises(ValueError, match=rf"^who cuda:{count}: this machine has {devices} "
                                         rf"\(cuda:0 to cuda:{count - 1}\)$"):
        check_device(torch.device(f"cuda:{count}"), "who")


@pytest.mark.parametrize(("built", "said"), [(None, ", built without CUDA"), ("12.4", "")])
def test_no_device_says_whether_torch_was_built_with_cuda(monkeypatch, built, said):
    _cuda(monkeypatch, False, 0, built)
    with pytest.raises(ValueError) as err:
        check_device(torch.device("cuda"), "who")
    assert str(err.value) == (f"who cuda: this torch sees no cuda device (torch "
                              f"{torch.__version__}{said}); cpu runs here")


def test_an_unavailable_backend_sees_no_device_whatever_its_count(monkeypatch):
    _cuda(monkeypatch, False, 2, "12.4")
    with pytest.raises(ValueError, match="this torch sees no cuda device"):
        check_device(torch.device("cuda:0"), "who")
    check_device(torch.device("cpu"), "who")  # the CPU is always there
