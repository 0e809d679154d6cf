"""``imatrix_mse`` weight roles: their layers' input importance, gathered in the pass.

llm-compressor's ``imatrix_mse`` weighs each input channel's error in a weight's range search
by that channel's mean ``x^2`` over the calibration activations. A weight is observed before
any activation, so :func:`~.observe.make_plan` holds back the observations of the native
``imatrix_mse`` observers given no ``importance`` of the user's (``slot.waiting``);
:func:`gather` hooks their layers (:class:`~..choice.importance.InputImportance`: one sum of
``x^2`` and a row count per layer, no rows kept) for the pass, and :func:`observe_waiting`
observes them after it with their layer's mean, along the weight's input-channel dim (a
Conv1D's ``[in, out]``: dim 0). A layer whose input the pass never saw (not called, or not
Linear-like: a conv) is searched unweighted: :func:`unweighted` lists those of a recipe
(an ``auto`` role's ``imatrix_mse`` candidate too) for its info and warning.
"""

from __future__ import annotations

import torch

from ..choice.importance import InputImportance
from ..recipe import AUTO
from ..structure.conv1d import is_conv1d
from .observe import observe_weights, observer_key, unique_slots, waits_for_importance

__all__ = ["gather", "held", "observe_waiting", "unweighted"]


def _imatrix_slots(slots) -> list:
    """The weight slots with an observer that waits for importance, on every rank (a rank
    observes only the weights it owns: ``slot.waiting`` is empty elsewhere)."""
    return [s for s in unique_slots(slots.values()) if s.role == "weight"
            and any(waits_for_importance(k) for k in s.observers)]


def held(slots) -> list:
    """The observers that wait for importance, in slot order: every rank's same list (what
    the distributed pass syncs once they observed)."""
    return [o for s in _imatrix_slots(slots) for k, o in s.observers.items()
            if waits_for_importance(k)]


def gather(model, slots) -> InputImportance | None:
    """The importance hooks of the layers whose weights wait for it (None where none waits);
    they count the pass's forwards (:func:`~.observe.in_pass`) until :func:`observe_waiting`."""
    layers = sorted({s.layer for s in _imatrix_slots(slots)})
    if not layers:
        return None
    # a layer one of whose observers reads NaN / inf as zero reads them so in its sums too
    # (else one inf makes its importance unusable and its weight searched unweighted)
    ignore = {s.layer for s in unique_slots(slots.values()) if s.layer in layers
              and any(getattr(o, "non_finite", None) == "ignore" for o in s.observers.values())}
    return InputImportance(model, layers, ignore)


def _input_dim(module) -> int:
    """The weight's dim of input channels: -1 of a Linear's ``[out, in]``, 0 of a Conv1D's."""
    return 0 if is_conv1d(module) else -1


def _why_unweighted(slot, imp) -> str | None:
    w, d = slot.module.weight, _input_dim(slot.module)
    if imp is None:
        return "its input was never seen in the pass: not called, no rows, or not Linear-like"
    if imp.numel() != w.shape[d]:
        return f"its input has {imp.numel()} channels, its weight's input dim {w.shape[d]}"
    if not bool(torch.isfinite(imp).all()):
        return "its input brought NaN or inf"
    return None


def observe_waiting(slots, means: dict | None) -> None:
    """Observe every waiting weight with its layer's mean ``x^2`` (``means``:
    :meth:`InputImportance.means`, every rank's in a distributed pass), which every rank's
    observer of it holds, owner or not; the observers of a layer without one search
    unweighted, the reason in ``slot.unweighted`` (on every rank)."""
    targets = _imatrix_slots(slots)
    if means is None or not targets:
        return
    for slot in targets:
        why = _why_unweighted(slot, means.get(slot.layer))
        if why is not None:
            slot.unweighted.update({k: why for k in slot.observers if waits_for_importance(k)})
            continue
        imp = means[slot.layer].to(slot.module.weight.device, torch.float32)
        # every rank's observer, not the owner's alone (``slot.waiting``): a fusion group's
        # joined search reads it on every rank (finish._joined_options), and the sync that
        # shares the owner's state carries no setting
        for key, obs in slot.observers.items():
            if waits_for_importance(key):
                obs.importance, obs.input_dim = imp, _input_dim(slot.module)
    observe_weights([p for s in targets for p in s.waiting])
    for slot in targets:
        slot.waiting = []


def unweighted(slots, plan) -> list[dict]:
    """``[{"layer", "reason"}]``: the weight roles of ``plan`` whose ``imatrix_mse`` search
    ran without input importance: the role's observer, or a candidate of its ``auto``
    (``names``: :func:`~.observe.candidates_for`), which then competed unweighted."""
    out = []
    for (layer, role), (cfg, names) in plan.items():
        if role != "weight" or cfg.dynamic is True:
            continue
        slot = slots[(layer, role)]
        for n in names:
            key = observer_key(n, cfg, slot.module)
            if not waits_for_importance(key) or key not in slot.observers:
                continue
            why = slot.unweighted.get(key)
            if why is not None:
                out.append({"layer": layer, "reason": f"auto's candidate {n}: {why}"
                            if cfg.observer == AUTO else why})
    return out
