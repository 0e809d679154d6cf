"""Model-level calibration: recipes, the calibration pass, QDQ, reports, plots, save / load.

Four jobs, one subpackage each: :mod:`.run` (the calibration pass and what feeds it),
:mod:`.choice` (choosing ranges by the model's output), :mod:`.structure` (what the runtime
runs: fused layers, experts, the KV cache) and :mod:`.results` (the result and its uses);
:mod:`.recipe` and :mod:`.options` are shared by all four.
"""

from .choice.sensitivity import Sensitivity, fallback_curve, keep_float
from .options import Auto, MoE, Outliers, Runtime, Sampling, Sequential
from .recipe import PRESETS, RECIPES, ROLES, Recipe, Role, Rule, preset
from .results.apply import QDQHandle, apply, qdq_tensor
from .results.io import load, save
from .results.report import Report
from .results.result import Calibration, RoleState
from .run.checkpoint import empty_model
from .run.session import calibrate, calibrate_many, sensitivity

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


# ``quantscope.calibrate`` is the function :func:`calibrate`, while the documented spellings
# ``quantscope.calibrate.load``, ``.preset``, ``.Recipe`` ... keep working: each public name of
# this package is also an attribute of the function. Set here, once, so no module needs to swap
# its class to be callable (issue 36 item 5).
for _name in __all__:
    setattr(calibrate, _name, globals()[_name])
del _name
