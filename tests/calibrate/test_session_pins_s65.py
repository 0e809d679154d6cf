"""Pins from a mutation round over ``calibration/run/session.py`` (s65): what calibrate() and
calibrate_many() check before a pass, how ``observer=`` and ``batches=None`` are taken, and
what the outcome (each :class:`Calibration`'s ``info``) holds; behaviour no test held, each
expected value read from the docstrings and the error messages' own promises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantscope.calibration import Runtime, calibrate, calibrate_many, preset


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))


def _batches(n=2):
    torch.manual_seed(1)
    return [torch.randn(4, 128) for _ in range(n)]


def test_observer_replaces_the_observers_of_a_recipe_object():
    """calibrate's docstring: ``observer`` replaces the recipe's observers, a Recipe's too."""
    cal = calibrate(_mlp(), _batches(), preset("w8a8"), observer="percentile", progress=False)
    assert cal.recipe == preset("w8a8").with_observer("percentile")
    assert cal.states["0"]["input"].observer == "percentile"


def test_no_batches_given_calibrates_a_weight_only_recipe_on_zero_batches():
    """``batches=None`` stands for no batches: a weight-only recipe needs none."""
    cal = calibrate(_mlp(), None, "w4a16", progress=False)
    assert cal.info["batches"] == 0
    assert set(cal.states) == {"0", "2"}


def test_sequential_refuses_time_groups_by_name():
    with pytest.raises(ValueError, match=r"^calibrate: Runtime\.time_groups is not available "
                                         r"with sequential$"):
        calibrate(_mlp(), _batches(), "w8a8", sequential=True, progress=False,
                  runtime=Runtime(time_groups={"g": ["w8a8"]}))


@pytest.mark.parametrize("recipes", [[], {}, ()])
def test_an_empty_set_of_recipes_is_refused(recipes):
    with pytest.raises(ValueError, match=r"^calibrate: no recipe given$"):
        calibrate_many(_mlp(), _batches(), recipes, progress=False)


def test_empty_batches_are_refused_when_any_recipe_quantizes_activations_statically():
    """A weight-only recipe beside a static one does not excuse the static one's empty pass."""
    with pytest.raises(ValueError, match=r"^calibrate: batches is empty: the recipe quantizes "
                                         r"activations statically"):
        calibrate_many(_mlp(), [], ["w4a16", "w8a8"], progress=False)


def test_a_calibration_made_in_one_process_has_no_writer_rank_and_no_process_count():
    """Calibration's docstring: ``writer_rank`` is None for one made in this process alone;
    ``info['processes']`` counts a data-parallel pass's processes, so a local pass has none."""
    cal = calibrate(_mlp(), _batches(), "w8a8", progress=False)
    assert cal.writer_rank is None
    assert "processes" not in cal.info
    assert cal.info["batches"] == 2


def test_a_time_group_counts_the_pass_shared_time(monkeypatch):
    """Runtime.time_groups: a group's seconds are the pass's shared time plus its recipes'
    own observers, as each recipe's ``calibration_seconds``. A fake clock moves only in the
    model's forwards (shared time), so a one-recipe group equals that recipe's time exactly."""
    import importlib
    import types

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    for name in ("choice.auto", "run.finish", "run.observe", "choice.sensitivity", "run.session"):
        monkeypatch.setattr(importlib.import_module(f"quantscope.calibration.{name}"), "time",
                            clock)

    class Tick(nn.Module):
        def forward(self, x):
            now[0] += 0.5
            return x

    model = nn.Sequential(Tick(), _mlp())
    out = calibrate_many(model, _batches(), {"a": "w8a8", "b": "w8a8"}, progress=False,
                         runtime=Runtime(time_groups={"g": ["a"]}))
    seconds = out["a"].info["calibration_seconds"]
    assert seconds >= 1.0  # two batches' forwards at least
    assert out["a"].info["group_seconds"] == {"g": seconds}
    assert "group_seconds" not in out["b"].info


def test_calibrate_labels_its_calibration_by_the_recipe_name():
    """One recipe, labelled as a list's are: by its name (the label saved with it)."""
    from dataclasses import replace

    recipe = replace(preset("w8a8"), name="mine")
    cal = calibrate(_mlp(), _batches(), recipe, progress=False)
    assert cal.label == "mine"
    assert cal.recipe.name == "mine"


def test_info_reports_the_min_tokens_the_experts_ran_with():
    """``info['expert_min_tokens']``: the MoE(min_tokens=) of the call, not the default."""
    from test_moe import OldMoe

    from quantscope.calibration import MoE

    torch.manual_seed(0)
    model = nn.Sequential(OldMoe()).eval()
    batches = [torch.randn(2, 8, 64) for _ in range(2)]
    cal = calibrate(model, batches, "w8a8", moe=MoE(min_tokens=7), progress=False)
    assert "experts" in cal.info
    assert cal.info["expert_min_tokens"] == 7 != MoE().min_tokens
