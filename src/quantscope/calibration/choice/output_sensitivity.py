"""The ranking by the model's output (:func:`measure`, what ``quantscope.sensitivity``
returns), and the checks it shares with :func:`~.sensitivity.layer_sensitivity`.

Kept apart from :mod:`.sensitivity` (the per-layer ranking and the float fallback), which
re-exports :func:`measure`.
"""

from __future__ import annotations

import time

from torch import nn
from torch.nn.modules.conv import _ConvNd

from ..results.apply import refuse_applied
from ..results.result import Calibration
from ..run.batches import length_checked
from ..run.observe import with_progress
from ..structure.placement import check_module
from ..structure.tied import tied_weights
from .auto import OutputDivergence
from .ranking import Sensitivity

__all__ = ["measure"]


def _metric_name(div: OutputDivergence) -> str:
    if div.loss is not None:
        return "loss"
    return {"kl": "KL(next token)", "cos": "1 - cosine"}[div.references[0][0]]


def measure(model: nn.Module, batches, calibration: Calibration, loss=None,
            roles=("weight", "input"), progress: bool = False) -> Sensitivity:
    """:func:`~.session.sensitivity` of a given ``calibration``: each of its tensors of
    ``roles`` quantized alone, the model's output divergence on ``batches``. ``model`` must
    be the one calibrated, as ``calibration.apply`` checks (``Calibration.check_model``). A
    weight several calibrated layers hold (tied) is one tensor: measured once, with all
    their states, its rows share that divergence, and ``info["tied"]`` lists the holders."""
    batches = check_call("sensitivity", model, batches, calibration)
    t0 = time.perf_counter()
    div = OutputDivergence(model, batches, loss, who="sensitivity")
    todo = [(layer, role, st) for layer, rs in calibration.states.items()
            for role, st in rs.items() if role in roles]
    if not todo:
        raise ValueError(f"sensitivity: the calibration quantizes no tensor of roles {roles}")
    tied = _tied(model, calibration, [layer for layer, role, _ in todo if role == "weight"])
    todo = with_progress(todo, progress, "sensitivity", desc="sensitivity", unit="tensor")
    once: dict[tuple[str, ...], float] = {}  # a tied tensor's divergence, measured once

    def divergence(layer, role, st):
        holders = tied.get(layer) if role == "weight" else None
        if holders is None:
            return div.of({layer: {role: st}})
        if holders not in once:  # all its holders' states: what calibration.apply runs
            once[holders] = div.of({h: {"weight": calibration.states[h]["weight"]}
                                    for h in holders})
        return once[holders]

    rows = [{"layer": layer, "role": role, "observer": st.observer,
             "divergence": divergence(layer, role, st)} for layer, role, st in todo]
    rows.sort(key=lambda r: -r["divergence"])
    for k, r in enumerate(rows, 1):
        r["rank"] = k
    modules = dict(model.named_modules())  # (an MoE expert's view is no convolution)
    return Sensitivity(rows, {"metric": _metric_name(div), "forwards": div.forwards,
                              "batches": len(div.batches),
                              "seconds": round(time.perf_counter() - t0, 2),
                              "convolutions": convolutions(
                                  {r["layer"]: modules.get(r["layer"]) for r in rows}),
                              "tied": [list(h) for h in sorted(set(tied.values()))]})


def _tied(model: nn.Module, calibration: Calibration, layers) -> dict[str, tuple[str, ...]]:
    """``{layer: every layer holding its weight, sorted}`` for those of ``layers`` whose
    weight other layers with a weight state hold too (a tied embedding and lm_head:
    :func:`~..structure.tied.tied_weights`' rule, apply()'s): one tensor, which apply()
    fake-quantizes once for all its holders, so :func:`measure` quantizes it once with all
    their states (one at a time, apply() warned that the others ran it quantized though not
    covered) and gives each holder's row that divergence. A holder without a state is left
    out: apply() names it, as ``calibration.apply`` does."""
    out = {}
    for layer, others in tied_weights(model, layers).items():
        covered = [o for o in others if calibration.states.get(o, {}).get("weight") is not None]
        if covered:
            out[layer] = tuple(sorted({layer, *covered}))
    return out


def check_call(who: str, model, batches, calibration):
    """:func:`measure`'s and :func:`~.sensitivity.layer_sensitivity`'s checks before any
    forward: batches as ``quantscope.sensitivity`` takes them (one tensor would be read row
    by row, one dict key by key; a batch of 0-token sequences is refused as calibrate
    refuses it), a Calibration, and ``model`` the float model it belongs to, by apply()'s
    own rule (``Calibration.check_model``: the weight fingerprints calibrate recorded, its
    SmoothQuant smoothing): a ranking of other weights ranks what apply() refuses to run
    (``calibration.without_fingerprints()`` takes them knowingly). Returns the batches to
    read (:func:`~..run.batches.length_checked`'s)."""
    batches = length_checked(batches, who=who)
    if not isinstance(calibration, Calibration):
        raise TypeError(f"{who}: calibration must be a Calibration, got "
                        f"{type(calibration).__name__}")
    check_module(model, who)
    refuse_applied(model, who, "its float reference would be the fake-quantized model")
    calibration.check_model(model, who)
    return batches


def convolutions(modules: dict) -> list[str]:
    """The names of ``{name: module}``'s convolutions: their activations ``[N, C, *spatial]``
    have no tokens (calibrate refuses a per-token one there: ``_ConvNd``, as it does), which
    :func:`~.sensitivity.keep_float` reads from the ranking's ``info["convolutions"]``."""
    return sorted(name for name, m in modules.items() if isinstance(m, _ConvNd))
