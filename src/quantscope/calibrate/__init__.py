"""Model-level calibration: recipes, the calibration pass, QDQ, reports, plots, save / load."""

from .apply import QDQHandle, apply, qdq_tensor
from .checkpoint import empty_model
from .io import load, save
from .options import Auto, MoE, Outliers, Runtime, Sampling, Sequential
from .recipe import PRESETS, RECIPES, ROLES, Recipe, Role, Rule, preset
from .report import Report
from .result import Calibration, RoleState
from .sensitivity import Sensitivity, fallback_curve, keep_float
from .session import calibrate, calibrate_many, sensitivity

__all__ = [
    "PRESETS",
    "RECIPES",
    "ROLES",
    "Auto",
    "Calibration",
    "MoE",
    "Outliers",
    "QDQHandle",
    "Recipe",
    "Report",
    "Role",
    "RoleState",
    "Rule",
    "Runtime",
    "Sampling",
    "Sensitivity",
    "Sequential",
    "apply",
    "calibrate",
    "calibrate_many",
    "empty_model",
    "fallback_curve",
    "keep_float",
    "load",
    "preset",
    "qdq_tensor",
    "save",
    "sensitivity",
]


class _CallableModule(type(__import__("sys"))):
    """``quantscope.calibrate(model, batches, recipe)`` calls :func:`calibrate` while
    ``quantscope.calibrate.load`` etc. stay reachable: the package itself is callable."""

    def __call__(self, model, batches, recipe="w8a8", **kwargs):
        return calibrate(model, batches, recipe, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
