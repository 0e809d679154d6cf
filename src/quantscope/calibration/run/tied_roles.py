"""Tied weights a recipe quantizes in two layers (a tied ``lm_head`` and embedding both
targeted, one ``q_proj`` Parameter in two decoder layers): ``apply()`` fake-quantizes one
weight once, so it refuses holders whose states quantize it differently. ``calibrate`` makes
sure it never returns such a calibration, refusing as early as the cause is known:

- :func:`check_recipes`, before anything runs: the holders' weight roles differ, or their
  observer reads more than the weight (``auto`` chooses per layer, but by the weight's own
  error alone under ``Auto(metric="tensor")`` without an importance-weighted candidate;
  ``imatrix_mse`` weighs by each layer's own inputs);
- :func:`check_groups`, once the fusion groups are found, before the pass over the data:
  the runtime shares a weight scale within a group, and the holders are in different ones;
- :func:`check_states`, on the result (a cause not foreseen, fusion groups found block by
  block in sequential calibration): the states compared as ``apply()`` compares them.

Each error names both layers and what to do: ignore one (it then runs the other's QDQ, as
``apply()`` warns), or untie them. The weights are one by :func:`~..structure.tied.memory`,
the rule ``apply()`` uses.
"""

from __future__ import annotations

import torch
from torch import nn

from ..recipe import AUTO
from ..structure.tied import memory, tied_weights
from .finish import joined_weights
from .module_roles import check_role_shape
from .observe import candidates_for, observer_key, waits_for_importance

__all__ = ["check_groups", "check_recipes", "check_states"]

_UNTIE = ("ignore one of the layers in the recipe (it then runs the other's QDQ), or untie "
          "the weights (.clone())")


def _error(label, a: str, b: str, why: str, fix: str = _UNTIE) -> ValueError:
    return ValueError(f"calibrate: recipe {label!r}: {a}.weight and {b}.weight are one weight "
                      f"(a tied Parameter, or one memory), but {why}, and apply() quantizes "
                      f"one weight once: {fix}")


def _tied(weights: dict) -> list[list[str]]:
    """The sets (2+, in ``weights``' order) of ``weights``' layers (``{layer: (module,
    ...)}``) holding one weight, each a module of its own."""
    found: dict = {}
    for layer, (module, *_) in weights.items():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            found.setdefault(memory(w), {}).setdefault(id(module), layer)
    return [list(by_module.values()) for by_module in found.values() if len(by_module) > 1]


def _apart(a, b, auto=None) -> str | None:
    """Why weight roles ``a`` and ``b`` of one weight may give it two states, None if they
    give it one: the roles differ, or the observer reads the layer, not the weight alone
    (``auto``: the :class:`~..options.Auto` an ``auto`` role chooses by)."""
    fields = _fields_apart(a, b)
    if fields:
        return f"their weight roles differ ({fields})"
    # option by option: Role's == cannot compare tensors of several values (an importance)
    ao, bo = dict(a.options), dict(b.options)
    keys = sorted(k for k in {*ao, *bo} if not _equal(ao.get(k), bo.get(k)))
    if keys:  # (the roles print alike)
        return f"their weight roles' options differ ({', '.join(keys)})"
    if a.observer == AUTO and not _by_weight_alone(a, auto):
        return ("observer 'auto' chooses each layer's qparams by that layer (its output error, "
                "its inputs' importance)")
    if waits_for_importance(observer_key(a.observer, a)):
        return "imatrix_mse weighs each layer's search by that layer's own inputs"
    return None


def _fields_apart(a, b) -> str:
    """What differs between weight roles ``a`` and ``b`` outside their options, each as
    "a's vs b's" ("" if nothing): the spec and observer (printed together), and the dynamic
    mode on its own (roles differing in it alone print alike by spec and observer)."""
    apart = []
    if (a.spec, a.observer) != (b.spec, b.observer):
        apart.append(f"{a.spec} {a.observer!r} vs {b.spec} {b.observer!r}")
    if a.dynamic != b.dynamic:
        apart.append(f"dynamic {a.dynamic!r} vs {b.dynamic!r}")
    return "; ".join(apart)


def _by_weight_alone(role, auto) -> bool:
    """Whether ``auto`` chooses a weight ``role``'s qparams by the weight alone: the metric
    ``"tensor"`` (each candidate's error on the weight itself), no candidate weighing by the
    layer's inputs."""
    return auto is not None and auto.metric == "tensor" and not any(
        waits_for_importance(observer_key(name, role))
        for name in candidates_for("weight", auto.candidates))


def _equal(x, y) -> bool:
    """Whether two option values are equal, in either order: a tensor only to a tensor of its
    shape and values (an observer may compute otherwise with a number than with a tensor of
    its value, by the tensor's dtype or device; ``==`` of several values is a tensor whose
    bool() raises), anything else by ``==``."""
    try:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.shape == y.shape and bool(torch.equal(x, y)))
        return bool(x == y)
    except (RuntimeError, TypeError):
        return False


def check_recipes(model: nn.Module, recipes: dict, auto=None) -> None:
    """Refuse, before anything runs, tied weights that two layers of a recipe would give two
    states by their roles (:func:`_apart`; ``auto``: the run's :class:`~..options.Auto`)."""
    for label, recipe in recipes.items():
        try:
            matched = recipe.match(model)
        except ValueError:  # nothing matches yet (MoE experts: once made Linear views)
            continue
        weights = {layer: (module, roles["weight"])
                   for layer, (module, roles) in matched.items() if "weight" in roles}
        for tied in _tied(weights):
            first, *others = [(n, check_role_shape(n, "weight", weights[n][1], weights[n][0]))
                              for n in tied]  # each as the pass will run it
            for other in others:
                why = _apart(first[1], other[1], auto)
                if why is not None:
                    raise _error(label, first[0], other[0], why)


def check_groups(plans: dict, groups, slots) -> None:
    """Refuse, once the fusion ``groups`` are found and before the pass, tied weights whose
    layers are in different groups sharing a weight scale (or one in such a group, one not):
    the group's joined observation gives each another scale."""
    for label, plan in plans.items():
        joined = {}
        for group in groups:
            members, _ = joined_weights(group, plan, slots)
            joined.update({m: tuple(members) for m in members})
        weights = {layer: (slots[(layer, role)].module,)
                   for layer, role in plan if role == "weight"}
        for first, *others in _tied(weights):
            for other in others:
                if joined.get(first) != joined.get(other):
                    a, b = (list(joined.get(n, ())) or "none" for n in (first, other))
                    raise _error(label, first, other, (
                        f"the fusion groups whose weight scale the runtime shares differ "
                        f"({a} vs {b})"), f"{_UNTIE}, or split them out of their groups "
                                           f"(Recipe.split)")


def check_states(model: nn.Module, calibrations: dict) -> dict:
    """Refuse a result whose tied weights got two states all the same (as ``apply()`` would
    refuse it); returns ``calibrations``."""
    for label, calibration in calibrations.items():
        states = calibration.states
        layers = [layer for layer, roles in states.items() if "weight" in roles]
        for layer, others in tied_weights(model, layers).items():
            for other in others:
                st = states.get(other, {}).get("weight")
                if st is not None and not st.quantizes_like(states[layer]["weight"]):
                    raise _error(label, layer, other, "they were calibrated to different "
                                                      "qparams")
    return calibrations
