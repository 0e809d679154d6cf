"""Write a calibration's folder (what :func:`.io.load` reads back): safetensors for the
tensors, JSON for the rest (the format is described in :mod:`.io`). Below :mod:`.result`, so
``Calibration.save`` calls it without an import circle."""

from __future__ import annotations

import os

from ... import comm
from ..._checks import check_bool, check_path
from ...exporters.atomic import atomic_dir
from .info_check import info_problem
from .report import json_text

__all__ = ["FORMAT", "META", "READS", "SMOOTH", "TENSORS", "VERSION", "safetensors", "save"]

TENSORS = "qparams.safetensors"
META = "quantscope.json"
FORMAT = "quantscope-calibration"
#: the version written; 2: a static input / output or KV-cache role may carry the fingerprint
#: of the weight its values came through (a version-1 reader refuses that, so it reads "got 2")
VERSION = 2
#: the versions read (1: fingerprints on weight roles only; nothing else differs)
READS = (1, 2)
#: key prefix of SmoothQuant's per-channel scales in the tensors file (``Calibration.smoothing``);
#: a layer may be named ``#smooth`` too: load reads the roles' keys first (:func:`_check_smooth`)
SMOOTH = "#smooth/"
#: the ``{layer}/{role}/{field}`` tensors a role may store
FIELDS = ("lo", "hi", "global_amax", "scale", "zero_point", "global_scale", "g_idx")


def safetensors():
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        raise ImportError("save / load need safetensors: pip install 'quantscope[model]'") from None
    return save_file, load_file


def _check_smooth(key: str, states) -> str:
    """``key``, refused where a role could read it: a layer named ``#smooth`` stores
    ``#smooth/{role}/{field}`` tensors, which load reads as that role's before it takes the
    other ``#smooth/`` keys as SmoothQuant scales (a smoothed module named ``input/scale``
    beside it would be read as the role's scale)."""
    owner, _, field = key.rpartition("/")
    layer, _, role = owner.rpartition("/")
    if field in FIELDS and role in states.get(layer, {}):
        raise ValueError(f"save: the SmoothQuant scale of {key[len(SMOOTH):]!r} would be "
                         f"stored as {key!r}, the key of layer {layer!r}'s {role} {field}; "
                         f"rename one of the two modules")
    return key


def save(calibration, path, *, overwrite: bool = True) -> str:
    """Write ``calibration`` to directory ``path``; returns the path.

    Atomic: the files are written into a temporary folder beside ``path`` that is then
    renamed into place, so ``path`` holds either the complete new calibration or what it
    held before (an existing ``path`` is replaced only if it is an earlier calibration
    quantscope wrote, never an export, a run or another folder, nor the working folder:
    :func:`~quantscope.exporters.atomic.check_writable_target`; ``overwrite=False`` refuses it).

    Inside a process group of several processes, a calibration made across it
    (``Runtime(distributed=True)``) or read from disk is written by one process, its
    ``writer_rank`` (as the exporters); the others return ``path`` at once, with no
    collective, and log that they wrote nothing (logger ``quantscope``, INFO). One made in
    this process alone (``writer_rank`` None) is written here.
    """
    # by its fields: .result imports this module (save(model, path): say so, not .label)
    if not all(hasattr(calibration, f) for f in ("states", "recipe", "label", "smoothing",
                                                 "info")):
        raise TypeError(f"save: calibration must be a Calibration (what calibrate returns), "
                        f"got {type(calibration).__name__}")
    if not isinstance(calibration.label, str):  # load() reads back a str: refuse, not write
        raise TypeError(f"save: the calibration's label must be a str, got "
                        f"{calibration.label!r}; set calibration.label to one")
    if (found := info_problem(calibration.info)) is not None:  # load() would refuse it
        raise ValueError(f"save: the calibration's {found[0]}: {found[1]} (quantscope reads "
                         f"that entry back: calibration/results/info_check.py)")
    path = check_path("save", path)
    check_bool("save", "overwrite", overwrite)  # on every rank; bool("no") is True
    if not comm.writes_here(getattr(calibration, "writer_rank", None), "save", path):
        return path
    save_file, _ = safetensors()
    tensors, layers = {}, {}
    for layer, roles in calibration.states.items():
        for role, st in roles.items():
            key = f"{layer}/{role}"
            # an act-order group's column order: the spec's JSON keeps only "group:N"
            g_idx = getattr(st.spec.layout, "g_idx", None)
            fields = {"lo": st.lo, "hi": st.hi, "global_amax": st.global_amax,
                      "g_idx": None if g_idx is None else g_idx.long()}
            if st.qparams is not None:
                fields.update(scale=st.qparams.scale, zero_point=st.qparams.zero_point,
                              global_scale=st.qparams.global_scale)
            for name, t in fields.items():
                if t is not None:
                    tensors[f"{key}/{name}"] = t.detach().cpu().clone().contiguous()
            layers.setdefault(layer, {})[role] = {
                "spec": st.spec.to_dict(), "observer": st.observer, "requested": st.requested,
                "dynamic": st.dynamic, "options": dict(st.options),
                "shape": None if st.shape is None else list(st.shape),
                **({} if st.fingerprint is None else {"fingerprint": st.fingerprint})}
    for name, s in calibration.smoothing.items():
        tensors[_check_smooth(f"{SMOOTH}{name}", calibration.states)] = \
            s.detach().cpu().float().contiguous()
    meta = {"format": FORMAT, "version": VERSION, "label": calibration.label,
            "recipe": calibration.recipe.to_dict(), "info": calibration.info, "layers": layers}
    # what="calibration": never over the export the calibration may have been read from
    with atomic_dir(path, overwrite=overwrite, what="calibration") as tmp:
        save_file(tensors, os.path.join(tmp, TENSORS))
        with open(os.path.join(tmp, META), "w") as f:
            f.write(json_text(meta, indent=1))
    return str(path)
