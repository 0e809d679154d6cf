"""compressed-tensors' module matching in time linear in the modules, for its configs.

A mixed-precision export gives each scheme's config group every layer it quantizes by name,
hundreds of targets: compressed-tensors' ``is_match`` / ``match_named_modules`` test each
module against every target, and a recipe's rules in the order compressed-tensors resolves
them are as many, so writing and reading such a config was quadratic in layers. Here a
layer's name is looked up, and the other targets are compressed-tensors' to match; a recipe's
rules are found by :meth:`~quantscope.calibration.Recipe.rule_for` (its lookups).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .read_checks import exact_pattern

__all__ = ["Targets", "match_named", "matched", "precedence", "winners"]


class Targets:
    """``compressed_tensors.utils.match.is_match(name, module, targets)`` as a callable: a
    target that is no ``re:`` one and no identifier (a dotted layer name: no class is named
    so) takes the module of that name alone, so those are looked up; the others (regular
    expressions, class names, a top-level module's name) go through ``is_match`` itself."""

    def __init__(self, targets):
        from compressed_tensors.utils.match import is_match

        targets = [targets] if isinstance(targets, str) else list(dict.fromkeys(targets or ()))
        self._names = {t for t in targets if not t.startswith("re:") and not t.isidentifier()}
        self._rest = [t for t in targets if t not in self._names]
        self._is_match = is_match

    def __call__(self, name: str, module: nn.Module) -> bool:
        if name in self._names:  # (is_match refuses compressed-tensors' internal modules)
            return self._is_match(name, module, name)
        return bool(self._rest) and self._is_match(name, module, self._rest)


def match_named(model: nn.Module, targets, ignore=None):
    """compressed-tensors' ``match_named_modules(model, targets, ignore)``: ``(name,
    module)`` of each module a target takes and no ignore entry does, in
    ``model.named_modules()`` order."""
    take, skip = Targets(targets), Targets(ignore)
    for name, module in model.named_modules():
        if take(name, module) and not skip(name, module):
            yield name, module


def precedence(qconfig, groups: dict, model) -> tuple[list, list]:
    """``(rules, their groups)``: the groups' rules split by target in the order
    compressed-tensors picks the one scheme of a module several groups match
    (``match_targets``): a target naming it exactly, then a ``re:`` one, then a class name,
    each kind sorted as it sorts them; a target two groups name is the later one's. A
    quantscope recipe takes a module's first matching rule, so it resolves them alike.
    ``groups``: :func:`~quantscope.exporters.read._group`'s, by group name."""
    owner = {t: g for g, s in qconfig.config_groups.items() for t in s.targets}
    names = {n for n, _ in model.named_modules()}
    classes = {c.__name__ for m in model.modules() for c in type(m).__mro__}
    ordered = sorted(owner, key=lambda t: ("re:" in t, t))
    by_name = [(exact_pattern(t, classes), owner[t]) for t in ordered
               if t.startswith("re:") or t in names]
    by_class = [(t, owner[t]) for t in ordered if not t.startswith("re:")
                and t.isidentifier() and (t not in names or t in classes)]
    runs = []  # [group, its targets]: a run of one group's targets is one rule
    for t, g in by_name + by_class:
        if runs and runs[-1][0] == g:
            runs[-1][1].append(t)
        else:
            runs.append((g, [t]))
    return [replace(groups[g][0], targets=tuple(ts)) for g, ts in runs], [g for g, _ in runs]


def winners(qconfig, rules, ignore, of, model):
    """``(name, module, group)`` of each module the config quantizes, in its one group:
    those of :func:`matched` the group's rule takes a role of (one holding the matched
    Linears, a norm, is left out, as compressed-tensors quantizes only the Linear / Embedding
    layers a target matches)."""
    from ..calibration.structure.placement import taken_roles

    for name, module, group, rule in matched(qconfig, rules, ignore, of, model):
        if taken_roles(name, module, rule, "compressed-tensors")[0]:
            yield name, module, group


def matched(qconfig, rules, ignore, of, model):
    """``(name, module, group, rule)`` of each module the config groups' targets match:
    compressed-tensors' ``match_named_modules`` on all the groups' targets, each module in
    the group of the recipe's rule for it (:func:`precedence`)."""
    from ..calibration.recipe import Recipe

    if not rules:  # a KV cache alone
        return
    recipe = Recipe(tuple(rules), ignore, "compressed-tensors")
    index = {id(r): i for i, r in enumerate(recipe.rules)}
    targets = [t for s in qconfig.config_groups.values() for t in s.targets]
    for name, module in match_named(model, targets, qconfig.ignore):
        rule = recipe.rule_for(name, module)
        if rule is not None:
            yield name, module, of[index[id(rule)]], rule
