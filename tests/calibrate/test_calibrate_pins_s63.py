"""Pins from a mutation round over calibration's choice layer, recipes and results (s63):
behaviour no test held, each pinned by its definition (docstrings, docs/, formulas)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from torch import nn

from quantscope.calibration import preset
from quantscope.calibration.choice import auto
from quantscope.calibration.choice.auto import choose, choose_roles


class _Table:
    """A fake OutputDivergence: ``pieces`` pieces, the divergence of each configuration
    (named by its states) per piece read from ``table``; every call recorded."""

    def __init__(self, table: dict):
        self.table, self.calls = table, []
        self.pieces = len(next(iter(table.values())))

    def of(self, states, k):
        self.calls.append((states, k))
        return self.table[states][k]


def test_choose_drops_by_the_documented_factor_of_one_and_a_half_by_default():
    """docs/benchmarks.md: candidates more than 1.5x the best are dropped after the first
    piece; 1.6x goes, 1.4x stays (with no ``drop`` given: the default factor)."""
    div = _Table({"a": [1.0, 1.0], "far": [1.6, 0.0], "near": [1.4, 0.9]})
    best, scores = choose(div, {"a": "a", "far": "far", "near": "near"}, "a")
    assert scores["far"] == (1.6, 1)  # dropped after piece 0, though it would have won
    assert scores["near"] == (pytest.approx(1.15), 2)
    assert best == "a"


def _config(weight: str, inp: str):
    st = lambda o: SimpleNamespace(observer=o)
    return SimpleNamespace(states={"l0": {"weight": st(weight), "input": st(inp)}})


def test_choose_roles_keeps_scoring_a_trial_that_only_ties_the_kept_so_far():
    """choose_roles abandons a trial once its mean so far *exceeds* the kept one's: a trial
    equal on the first piece and better on the later ones is scored to the end and kept."""
    configs = {"minmax": _config("memoryless_minmax", "minmax"),
               "mse": _config("memoryless_mse", "mse")}
    table = {("memoryless_mse", "minmax"): [1.0, 0.5, 0.5]}

    class Div:
        pieces = 3

        def of(self, states, k):
            key = (states["l0"]["weight"].observer, states["l0"]["input"].observer)
            return table.get(key, [2.0] * 3)[k]

    roles, tried = choose_roles(Div(), configs, "minmax", [1.0, 1.0, 1.0], alive=["minmax"])
    assert roles == {"weight": "mse", "input": "minmax"}
    assert tried["weight=mse"] == (pytest.approx(2.0 / 3), 3)


def test_choose_roles_keeps_the_whole_configuration_when_a_trial_only_ties_it():
    """A trial is kept only when it completes every piece with a *lower* mean; one equal to
    the kept configuration on every piece leaves the role with ``best``."""
    configs = {"minmax": _config("memoryless_minmax", "minmax"),
               "mse": _config("memoryless_mse", "mse")}

    class Div:
        pieces = 2

        def of(self, states, k):
            return 1.0  # every trial ties the kept configuration's [1.0, 1.0]

    roles, tried = choose_roles(Div(), configs, "minmax", [1.0, 1.0], alive=["minmax", "mse"])
    assert roles == {"weight": "minmax", "input": "minmax"}
    assert tried == {"weight=mse": (1.0, 2), "input=mse": (1.0, 2)}



def test_decide_tries_other_roles_only_from_the_candidates_still_alive(monkeypatch):
    """After :func:`choose`, roles other than the weights are re-chosen among the candidates
    still alive (scored on every piece); one dropped after the first piece is not tried."""
    seen = {}

    def fake_choose(div, configs, first, pieces=None):
        pieces.update({n: [1.0, 1.0, 1.0] for n in configs})
        return "minmax", {"minmax": (1.0, 3), "mse": (9.0, 1), "mix": (1.2, 3)}

    def fake_choose_roles(div, configs, best, best_pieces, alive):
        seen["alive"] = alive
        raise LookupError("stop: the alive list is what is checked")

    monkeypatch.setattr(auto, "choose", fake_choose)
    monkeypatch.setattr(auto, "choose_roles", fake_choose_roles)
    model = nn.Sequential(nn.Linear(4, 4))
    configs = {n: SimpleNamespace(states={}) for n in ("minmax", "mse", "mix")}
    with pytest.raises(LookupError, match="stop"):
        auto._decide(model, SimpleNamespace(pieces=3), preset("w8a8", "auto"), "w8a8",
                     configs, {})
    assert seen["alive"] == ["minmax", "mix"]


def test_importance_is_gathered_only_for_layers_whose_weights_are_auto():
    """The imatrix weight candidate replaces no weight observer the user named: the input
    importance (hooks, a float64 sum per layer) is gathered for the ``auto`` weights only."""
    from quantscope import presets
    from quantscope.calibration.recipe import Recipe, Role, Rule

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    recipe = Recipe((Rule(("0",), weight=Role(presets.INT8_PER_CHANNEL, "auto")),
                     Rule(("1",), weight=Role(presets.INT8_PER_CHANNEL, "memoryless_mse"))))
    importance = auto._importance(model, {"r": recipe}, ["r"])
    try:
        assert sorted(importance.sums) == ["0"]
    finally:
        importance.remove()


def test_role_options_are_kept_sorted_so_their_order_does_not_matter():
    """Role.options is kept as a *sorted* tuple of pairs: observers are shared by their
    options, so the same options given in another order make an equal (same-hash) role."""
    from quantscope import presets
    from quantscope.calibration.recipe import Role

    spec = presets.INT8_PER_CHANNEL
    one = Role(spec, "mse", options={"maxshrink": 0.5, "grid": 50})
    two = Role(spec, "mse", options=[("grid", 50), ("maxshrink", 0.5)])
    assert one.options == (("grid", 50), ("maxshrink", 0.5))
    assert one == two and hash(one) == hash(two)


def test_with_role_observer_drops_the_options_of_the_observer_it_replaces():
    """with_role_observer runs the observer as named, with no options: the replaced
    observer's (an MSE search's ``maxshrink``) are not ones min-max takes."""
    from quantscope import presets
    from quantscope.calibration.recipe import Recipe, Role, Rule, with_role_observer

    weight = Role(presets.INT8_PER_CHANNEL, "mse", options={"maxshrink": 0.5})
    recipe = Recipe((Rule(("Linear",), weight=weight),))
    swapped = with_role_observer(recipe, "weight", "minmax").rules[0].weight
    assert (swapped.observer, swapped.options) == ("minmax", ())



def test_a_re_pattern_matches_from_the_start_of_the_name_not_the_whole_name():
    """Recipe targets: ``re:`` patterns match from the name's start as compressed-tensors
    does (``re.match``, not ``re.fullmatch``): ``re:model.layers`` takes its sublayers."""
    from quantscope.calibration.recipe_dict import matches

    linear = nn.Linear(2, 2)
    assert matches("re:model\\.layers", "model.layers.0.q_proj", linear)
    assert not matches("re:layers", "model.layers.0.q_proj", linear)  # not a search


def test_summary_clipped_is_the_mean_over_layers_and_the_sqnr_mean_skips_exact_rows():
    """summarize(): per role the *mean* clipped fraction over its rows, the mean SQNR over
    the finite ones (an exact row's inf left out), and the worst (least) SQNR's layer."""
    from quantscope.calibration.results.report import summarize

    row = lambda layer, sqnr, clipped: {"layer": layer, "role": "input",
                                        "observer": "minmax", "sqnr_db": sqnr,
                                        "clipped": clipped}
    got = summarize([row("a", 30.0, 0.1), row("b", 20.0, 0.3), row("c", math.inf, 0.2)])
    assert got["input"]["mean_clipped"] == pytest.approx(0.2)
    assert got["input"]["mean_sqnr_db"] == pytest.approx(25.0)
    assert (got["input"]["min_sqnr_db"], got["input"]["worst_layer"]) == (20.0, "b")
    assert got["input"]["exact_layers"] == 1 and got["input"]["layers"] == 3


def test_auto_lists_min_max_first_so_that_ties_keep_it():
    """choose() keeps the first candidate on a tie, "min-max by default": auto's default
    candidates start with min-max (so auto is never worse than min-max where they tie)."""
    from quantscope.calibration.run.observe import candidates_for

    assert candidates_for("input", None)[0] == "minmax"
    assert candidates_for("weight", None)[0] == "memoryless_minmax"



def test_run_time_roles_quantize_alike_only_with_the_same_observer_options():
    """RoleState.quantizes_like: a run-time (dynamic=True) role's observer *and options*
    compute its qparams at each call, so states differing in options (``non_finite``)
    do not quantize alike; equal ones do."""
    from quantscope import presets
    from quantscope.calibration.results.role_state import RoleState

    spec = presets.INT8_PER_TOKEN
    plain = RoleState(spec, "memoryless_minmax", "memoryless_minmax", True)
    same = RoleState(spec, "memoryless_minmax", "memoryless_minmax", True)
    ignoring = RoleState(spec, "memoryless_minmax", "memoryless_minmax", True,
                         (("non_finite", "ignore"),))
    assert plain.quantizes_like(same)
    assert not plain.quantizes_like(ignoring) and not ignoring.quantizes_like(plain)


def test_report_clip_range_spans_every_unit_of_a_per_channel_quantizer():
    """tensor_stats' clip_lo / clip_hi are the quantizer's range over all its units: the
    least lower edge (int8: -128 x scale) and the greatest upper one (127 x scale), here the
    wide channel's on both sides, not the narrow one's."""
    import torch

    from quantscope import presets
    from quantscope.calibration.results.report import tensor_stats
    from quantscope.calibration.results.role_state import RoleState
    from quantscope.qparams import qparams_from_range

    spec = presets.INT8_PER_CHANNEL
    qp = qparams_from_range(torch.tensor([-1.0, -4.0]), torch.tensor([1.0, 4.0]), spec)
    state = RoleState(spec, "minmax", "minmax", qparams=qp)
    got = tensor_stats(torch.tensor([[-1.0, 0.5], [-4.0, 3.0]]), state)
    wide = float(qp.scale.reshape(-1)[1])
    assert got["clip_lo"] == pytest.approx(-128 * wide)
    assert got["clip_hi"] == pytest.approx(127 * wide)
    assert (got["min"], got["max"], got["clipped"]) == (-4.0, 3.0, 0.0)
