"""A recipe's ``re:`` patterns compile once each, however many there are (found by probing,
s35: past 1024 distinct ones the pattern cache thrashed and every module's test recompiled
every pattern, 10x slower); the lookup that finds a module's first matching rule among
hundreds gives :func:`~quantscope.calibration.recipe_dict.matches`' answer."""

import itertools
import re

import pytest
from torch import nn

from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule
from quantscope.calibration.recipe_dict import matches

_compiler = getattr(re, "_compiler", None) or __import__("sre_compile")  # 3.11+: re._compiler


def test_more_re_patterns_than_any_cache_holds_compile_once_each(monkeypatch):
    compiled = []
    real = _compiler.compile
    monkeypatch.setattr(_compiler, "compile", lambda p, *a: compiled.append(p) or real(p, *a))
    n = 1100  # over the old cache's 1024 and re's own 512
    spec = QuantSpec("int8", "channel")
    # patterns no other test compiled (re's cache would hide nothing, ours would)
    rules = [Rule((f"re:s35_{i}_(?:a|b)$",), weight=Role(spec, "minmax")) for i in range(n)]
    recipe = Recipe((*rules, Rule(("Linear",), weight=Role(spec, "minmax"))))
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])
    for name, module in model.named_modules():  # each tests every pattern, none matches
        recipe.rule_for(name, module)
    ours = [p for p in compiled if isinstance(p, str) and p.startswith("s35_")]
    assert len(ours) <= n, f"{len(ours)} compilations of {n} patterns"  # old: about 7 * n


class Sub(nn.Linear):
    pass


def _modules():
    tree = nn.Sequential(nn.Linear(2, 2), Sub(2, 2), nn.ModuleDict({
        "a*b": nn.Linear(2, 2), "Linear": nn.ReLU(), "x": nn.Sequential(nn.Embedding(2, 2))}))
    return list(tree.named_modules())


_PATTERNS = ["0", "1", "Linear", "Sub", "torch.nn.modules.linear.Linear", "2.a*b", "2.a[*]b",
             "re:2\\.", "re:.*x", "2.x.0", "Embedding", "2.*", "?", "Module", "re:1$",
             "2.Linear", "nothing", "re:nothing", "[01]", "object"]


@pytest.mark.parametrize("seed", range(12))
def test_first_match_is_the_first_list_matches_takes(seed):
    """Lists of plain names, class names, globs and regexes, in any order."""
    import random

    from quantscope.calibration.recipe_dict import FirstMatch

    rnd = random.Random(seed)
    lists = [rnd.sample(_PATTERNS, rnd.randint(1, 3)) for _ in range(rnd.randint(1, 12))]
    first = FirstMatch(lists)
    for name, module in _modules():
        want = next((i for i, ps in enumerate(lists)
                     if any(matches(p, name, module) for p in ps)), None)
        assert first(name, module) == want, (name, lists)


def test_first_match_of_every_single_pattern_and_of_none():
    from quantscope.calibration.recipe_dict import FirstMatch

    for (name, module), p in itertools.product(_modules(), _PATTERNS):
        assert (FirstMatch([[p]])(name, module) == 0) == matches(p, name, module), (name, p)
        assert FirstMatch([])(name, module) is None


def _ignoring_recipe(n):
    """A model of n blocks of two Linears, and a recipe naming each layer: one rule per
    ``fc`` and every ``proj`` ignored (a recipe read back from a mixed checkpoint)."""
    spec = QuantSpec("int8", "channel")
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(n)])
    rules = [Rule((f"{i}.0",), weight=Role(spec, "minmax")) for i in range(n)]
    return model, Recipe(tuple(rules), tuple(f"{i}.1" for i in range(n)))


def test_the_ignore_list_is_looked_up_by_every_pass_over_the_modules(monkeypatch):
    """Found by review (s35): the unreached-weights check of every calibrate and the
    command line's 'left in float' note tested each module against every ignore entry
    (quadratic in layers), after rule_for had stopped doing so."""
    from quantscope.calibration import recipe_dict
    from quantscope.calibration.structure import moe
    from quantscope.cli.recipes import float_note

    calls = []
    real = recipe_dict.matches
    monkeypatch.setattr(recipe_dict, "matches", lambda *a: calls.append(a) or real(*a))
    counts = []
    for n in (40, 80):
        model, recipe = _ignoring_recipe(n)
        calls.clear()
        assert moe.unreached(model, recipe) == []
        note = float_note(recipe, model)
        recipe.match(model)
        counts.append(len(calls))
    assert note.startswith("left in float: 0.1, 1.1, 2.1, 3.1 and 76 more")
    assert counts[1] <= 2.2 * counts[0], counts  # old: about 4x
