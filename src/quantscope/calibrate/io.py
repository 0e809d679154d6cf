"""Save and load calibrated qparams: safetensors for the tensors, JSON for the rest.

``path/qparams.safetensors`` holds ``"{layer}/{role}/{field}"`` tensors (scale,
zero_point, global_scale, global_amax, lo, hi); ``path/quantscope.json`` the
recipe and, per layer and role, the spec, the observer used and the dynamic
mode. :func:`load` gives back a :class:`Calibration` whose ``apply(model)``
restores exactly the QDQ model that was saved, with no recalibration.
"""

from __future__ import annotations

import json
import os

from ..qparams import QParams
from ..spec import QuantSpec
from .recipe import Recipe
from .report import _json_safe
from .result import Calibration, RoleState

__all__ = ["META", "TENSORS", "load", "save"]

TENSORS = "qparams.safetensors"
META = "quantscope.json"
FORMAT = "quantscope-calibration"
VERSION = 1


def _safetensors():
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        raise ImportError("save / load need safetensors: pip install 'quantscope[model]'") from None
    return save_file, load_file


def save(calibration: Calibration, path) -> str:
    """Write ``calibration`` to directory ``path`` (created); returns the path."""
    save_file, _ = _safetensors()
    os.makedirs(path, exist_ok=True)
    tensors, layers = {}, {}
    for layer, roles in calibration.states.items():
        for role, st in roles.items():
            key = f"{layer}/{role}"
            fields = {"lo": st.lo, "hi": st.hi, "global_amax": st.global_amax}
            if st.qparams is not None:
                fields.update(scale=st.qparams.scale, zero_point=st.qparams.zero_point,
                              global_scale=st.qparams.global_scale)
            for name, t in fields.items():
                if t is not None:
                    tensors[f"{key}/{name}"] = t.detach().cpu().clone().contiguous()
            layers.setdefault(layer, {})[role] = {
                "spec": st.spec.to_dict(), "observer": st.observer, "requested": st.requested,
                "dynamic": st.dynamic, "options": dict(st.options),
                "shape": None if st.shape is None else list(st.shape)}
    save_file(tensors, os.path.join(path, TENSORS))
    meta = {"format": FORMAT, "version": VERSION, "label": calibration.label,
            "recipe": calibration.recipe.to_dict(), "info": calibration.info, "layers": layers}
    with open(os.path.join(path, META), "w") as f:
        json.dump(_json_safe(meta), f, indent=1)
    return str(path)


def load(path, device="cpu") -> Calibration:
    """Read a calibration written by :func:`save`; ``calibration.apply(model)`` applies it."""
    _, load_file = _safetensors()
    meta_path, tensor_path = os.path.join(path, META), os.path.join(path, TENSORS)
    for p in (meta_path, tensor_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"load: {p} does not exist (expected a directory written "
                                    f"by quantscope's save)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"load: {meta_path} is not a quantscope calibration "
                         f"(format {meta.get('format')!r})")
    tensors = load_file(tensor_path, device=str(device))
    states = {}
    for layer, roles in meta["layers"].items():
        for role, d in roles.items():
            key = f"{layer}/{role}"
            get = tensors.get
            qp = None
            if f"{key}/scale" in tensors:
                qp = QParams(tensors[f"{key}/scale"], tensors[f"{key}/zero_point"],
                             get(f"{key}/global_scale"))
            dyn = d["dynamic"]
            states.setdefault(layer, {})[role] = RoleState(
                QuantSpec.from_dict(d["spec"]), d["observer"], d["requested"], dyn,
                tuple(sorted(d.get("options", {}).items())), qp, get(f"{key}/global_amax"),
                get(f"{key}/lo"), get(f"{key}/hi"),
                None if d["shape"] is None else tuple(d["shape"]))
    return Calibration(Recipe.from_dict(meta["recipe"]), states, meta.get("label", ""),
                       info=meta.get("info", {}))
