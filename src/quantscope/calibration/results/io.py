"""Save and load calibrated qparams: safetensors for the tensors, JSON for the rest.

``path/qparams.safetensors`` holds ``"{layer}/{role}/{field}"`` tensors (scale,
zero_point, global_scale, global_amax, lo, hi, and an act-order group's int64 ``g_idx``,
which the spec's JSON does not hold); ``path/quantscope.json`` the recipe and, per layer
and role, the spec, the observer used and the dynamic mode (a static weight's shape, and
each calibrated role's fingerprint, too), and the format's name and ``version`` (checked on
load). Written atomically (:func:`~quantscope.exporters.atomic.atomic_dir`). :func:`load`
gives back a :class:`Calibration` whose ``apply(model)`` restores exactly the QDQ model that
was saved, with no recalibration, on the weights it was calibrated on: a SmoothQuant
calibration's (``smoothing``, saved beside the qparams) are the smoothed ones, so smooth a
freshly loaded float model first with :func:`~quantscope.calibration.choice.smooth.reapply`
(as ``quantscope evaluate`` / ``export`` do); ``apply`` refuses a model it can tell is not.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..._checks import check_path, pattern_refusal
from ..._jsonfile import read_json
from ...comm import main_global_rank
from ...exporters.atomic_swap import read_unchanged
from ...layout import Group, Tensor
from ...observers.registry import get_observer
from ...qparams import QParams, qparams_from_range
from ...scales import not_encoded
from ...spec import QuantSpec
from ..recipe import ROLES, Recipe, Role
from ..recipe_dict import role_options
from ..structure import kv_cache
from ..structure.fingerprint import check_fingerprint_text
from .info_check import info_problem
from .result import Calibration
from .role_state import RoleState
from .saving import FORMAT, META, READS, SMOOTH, TENSORS, safetensors, save

__all__ = ["META", "TENSORS", "check_patterns", "load", "save"]

#: the role names ``apply`` knows: a module's and the KV cache's
_ROLE_NAMES = (*ROLES, *kv_cache.ROLES)


def _safetensor_error() -> type:
    from safetensors import SafetensorError

    return SafetensorError


class _Damaged(ValueError):
    """A calibration folder that does not hold what :func:`save` writes."""


def _read_folder(path: str, meta_path: str, tensor_path: str, device) -> tuple[object, dict]:
    """The JSON data and the tensors, both of one version of the folder
    (:func:`read_unchanged`), though another process saves over it meanwhile."""
    _, load_file = safetensors()
    SafetensorError = _safetensor_error()
    for p in (meta_path, tensor_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"load: {p} does not exist (expected a directory written "
                                    f"by quantscope's save)")

    def read():
        try:
            meta = read_json(meta_path, "load")
        except ValueError as e:
            raise _Damaged(str(e)) from None
        try:
            return meta, load_file(tensor_path, device=str(device))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:  # no path in theirs
            raise _Damaged(f"load: {tensor_path}: not a readable safetensors file "
                           f"({type(e).__name__}: {e})") from None

    return read_unchanged(path, "load", read)


def load(path, device="cpu") -> Calibration:
    """Read a calibration written by :func:`save`; ``calibration.apply(model)`` applies it.

    Everything is checked before anything is returned: the format and version, every
    field's type, every tensor's dtype (the one save writes), shape (against its spec and the
    calibrated weight shape), finiteness and range (scales > 0 and held by their encoding:
    powers of two for pow2, within 2**-127..2**127 for E8M0, e4m3 values up to 448 for
    NVFP4's block scales; lo <= hi, zero points inside the code range, a symmetric spec's
    fixed one, an act-order ``g_idx`` a column order of its groups), and that each tensor
    belongs to a role of the JSON and its mode. Each role is one ``apply`` knows (a name of
    :data:`~quantscope.calibration.recipe.ROLES` or the KV cache's), a valid
    :class:`~quantscope.calibration.recipe.Role` (``"local"`` only under NVFP4's scales), a
    static weight records its shape (and a static or ``"local"`` one, where it has one, a
    fingerprint of the weight's bits: none in a folder saved before they were recorded; a
    ``"local"`` one saved then records no shape either; a static or ``"local"`` input,
    output or KV-cache role the fingerprint of the weight its values came through, none in
    a folder saved before), and a run-time role's observer
    is built as the forward builds it (a registered name taking its options). A
    damaged or edited folder raises ``ValueError`` naming the file and the key; an edit that
    stays a valid value (an int8 scale doubled) is not detected.
    """
    path = check_path("load", path)
    device = _load_device(device)
    meta_path, tensor_path = os.path.join(path, META), os.path.join(path, TENSORS)
    meta, tensors = _read_folder(path, meta_path, tensor_path, device)

    def bad(where, key, msg):
        return _Damaged(f"load: {where}: {key}: {msg}")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _Damaged(f"load: {meta_path} is not a quantscope calibration (format {got!r})")
    version = meta.get("version")
    if type(version) is not int or version not in READS:
        raise bad(meta_path, "version", f"this quantscope reads versions "
                                        f"{', '.join(map(str, READS))}, got {version!r}")
    for key, kind in (("layers", dict), ("recipe", dict), ("info", dict), ("label", str)):
        if key in ("layers", "recipe") and key not in meta:
            raise bad(meta_path, key, "missing")
        if key in meta and not isinstance(meta[key], kind):
            raise bad(meta_path, key, f"expected a {kind.__name__}, got "
                                      f"{type(meta[key]).__name__}")
    found = info_problem(meta.get("info", {}))
    if found is not None:
        raise bad(meta_path, *found)
    try:
        recipe = Recipe.from_dict(meta["recipe"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise bad(meta_path, "recipe", f"{type(e).__name__}: {e}") from None
    check_patterns(recipe, meta_path, bad)
    states, used = {}, set()
    for layer, roles in meta["layers"].items():
        if not isinstance(roles, dict):
            raise bad(meta_path, f"layers.{layer}", "expected a dict of roles")
        for role, d in roles.items():
            where = f"layers.{layer}.{role}"
            if role not in _ROLE_NAMES:  # a run-time role stores no tensor to refuse as stray
                raise bad(meta_path, where, f"unknown role {role!r} (expected one of "
                                            f"{', '.join(_ROLE_NAMES)})")
            states.setdefault(layer, {})[role] = _role_state(
                d, tensors, f"{layer}/{role}", lambda k, m, w=where: bad(meta_path, f"{w}.{k}", m),
                lambda k, m: bad(tensor_path, k, m), used, role)
    _refuse_stray(tensors, used, states, lambda k, m: bad(tensor_path, k, m))
    # a key the roles read is a layer's, one named "#smooth" (save refuses a smoothing key
    # a role could read)
    smoothing = {k[len(SMOOTH):]: _smoothing_scale(t, k, lambda k, m: bad(tensor_path, k, m))
                 for k, t in tensors.items() if k.startswith(SMOOTH) and k not in used}
    # in a process group every rank reads the folder: one writer, the default group's rank 0
    return Calibration(recipe, states, meta.get("label", ""), info=meta.get("info", {}),
                       smoothing=smoothing, writer_rank=main_global_rank())


def check_patterns(recipe: Recipe, path, bad) -> None:
    """Refuse (``bad(path, field, why)``) a ``re:`` target, ignore, fuse or split entry of a
    file someone else may have written (a saved calibration, a recipe file) that could
    backtrack for hours at ``apply()`` (:func:`~quantscope._checks.regex_problem`); a recipe
    built in Python is the author's own, and not checked so."""
    fields = [*((f"recipe.rules[{i}].targets", r.targets) for i, r in enumerate(recipe.rules)),
              *((f"recipe.fuse[{i}]", group) for i, group in enumerate(recipe.fuse)),
              ("recipe.split", recipe.split)]
    for field, values in [*fields, ("recipe.ignore", recipe.ignore)]:
        for p in values:
            why = pattern_refusal(p)
            if why:
                raise bad(path, field, why)


def _refuse_stray(tensors, used, states, bad_tensor) -> None:
    """Refuse a tensor no role read: one of a layer or role deleted from the JSON (that layer
    would run in float without a word), a field its mode does not store, or a key added.
    Besides the roles, save writes only SmoothQuant's ``#smooth/`` scales (the ``#smooth/``
    keys no role reads)."""
    for k in tensors:
        if k in used or k.startswith(SMOOTH):
            continue
        owner, _, field = k.rpartition("/")
        layer, _, role = owner.partition("/")
        if role not in states.get(layer, {}):
            raise bad_tensor(k, f"no role layers.{layer}.{role} in {META} reads it (expected "
                                f"only the '{{layer}}/{{role}}/{{field}}' tensors of its roles "
                                f"and '{SMOOTH}' scales; a role left out of {META} would run "
                                f"in float)")
        st = states[layer][role]
        read = sorted(u.rpartition("/")[2] for u in used if u.rpartition("/")[0] == owner)
        raise bad_tensor(k, f"role layers.{layer}.{role} ({st.spec}, dynamic={st.dynamic!r}) "
                            f"stores no {field!r} (expected only {read or 'no tensor'})")


def _smoothing_scale(t: torch.Tensor, key: str, bad_tensor) -> torch.Tensor:
    """A SmoothQuant scale, checked: one finite value > 0 per channel (reapply divides the
    weights by it)."""
    if t.dtype != torch.float32 or t.dim() != 1 or not t.numel():  # save writes .float()
        raise bad_tensor(key, f"expected a 1-D float32 tensor of channel scales, got {t.dtype} "
                              f"{tuple(t.shape)}")
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise bad_tensor(key, "must be finite and > 0 (a NaN, inf or zero scale divides the "
                              "weights into NaN)")
    return t


#: the dtype of stored ranges (lo / hi, global amax): observers give float32 ``[U]`` ranges,
#: and qparams_from_range computes in float32
_RANGE = torch.float32


def _role_state(d, tensors, key, bad_meta, bad_tensor, used, role) -> RoleState:
    spec, dyn, options, shape = _role_meta(d, bad_meta, role)
    get = _tensor_reader(tensors, key, dyn, bad_tensor, used)
    spec = _act_order(get, key, spec, shape, bad_tensor)
    _check_role(d, spec, dyn, options, bad_meta)
    # each mode reads only what save writes for it: run-time roles store no qparams, and
    # "local" ones only the whole-tensor amax (a stray scale is then refused, not applied)
    qp = _role_qparams(get, key, spec, shape, bad_tensor) if dyn is False else None
    gam = get("global_amax", _RANGE, required=True, nonneg=True) if dyn == "local" else None
    if gam is not None and gam.numel() != 1:
        raise bad_tensor(f"{key}/global_amax", f"expected one value, got {gam.numel()}")
    lo, hi = (None, None) if dyn is True else _role_range(get, key, qp, bad_tensor)
    return RoleState(spec, d["observer"], d["requested"], dyn,
                     options, qp, gam, lo, hi, shape, _fingerprint(d, dyn, bad_meta))


def _fingerprint(d, dyn, bad_meta) -> str | None:
    """A calibrated (static or ``"local"``) role's fingerprint, checked; absent (a
    calibration saved before they were recorded, or before roles other than weights recorded
    them: its model goes unchecked there) reads as None."""
    try:
        text = check_fingerprint_text(d.get("fingerprint"))
    except ValueError as e:
        raise bad_meta("fingerprint", str(e)) from None
    if text is not None and dyn is True:
        raise bad_meta("fingerprint", "only a calibrated (static or \"local\") role records "
                                      "one, not a run-time one (dynamic: true)")
    return text


def _role_range(get, key, qp, bad_tensor):
    """``(lo, hi)`` of a role, both or neither: one range per unit (the scale's units; one
    whole-tensor range without stored qparams), ``lo <= hi``."""
    lo, hi = get("lo", _RANGE), get("hi", _RANGE)
    if (lo is None) != (hi is None) or (lo is not None and lo.shape != hi.shape):
        raise bad_tensor(f"{key}/hi", "lo and hi must both be present, with one shape")
    if lo is None:
        return None, None
    units = 1 if qp is None else qp.scale.numel()
    if lo.numel() != units:
        raise bad_tensor(f"{key}/lo", f"{lo.numel()} values, expected one range per unit of "
                                      f"the role: {units}")
    if not bool((lo <= hi).all()):
        raise bad_tensor(f"{key}/lo", "above hi in some unit (a range is lo <= hi)")
    return lo, hi


def _act_order(get, key, spec, shape, bad_tensor) -> QuantSpec:
    """``spec`` with its act-order column order: a Group's saved ``g_idx``, checked by
    ``Group`` itself (1-D integers, ``size`` columns in each group ``0..groups-1``) and
    against the calibrated shape (one entry per column). Only a Group reads one: elsewhere
    it is refused as a stray tensor; a folder without one loads column-order groups."""
    lay = spec.layout
    g = get("g_idx", torch.int64) if isinstance(lay, Group) else None
    if g is None:
        return spec
    try:
        spec = spec.replace(layout=Group(lay.size, lay.axis, g_idx=g))
        if shape is not None:
            spec.layout.check(shape)
    except ValueError as e:
        raise bad_tensor(f"{key}/g_idx", f"not a column order of {lay} ({e})") from None
    return spec


def _check_role(d, spec, dyn, options, bad_meta) -> None:
    """The role as :class:`Role` takes it (``"local"`` needs NVFP4's global scale) and, for a
    run-time role, its observer as the forward builds it
    (:func:`~quantscope.observers.runtime.runtime_qparams`): else ``apply`` fails only at the
    first call, naming no file."""
    try:
        Role(spec, d["observer"], dyn, options)
    except ValueError as e:  # Role's message starts with the field it refuses
        msg = str(e)
        raise bad_meta(next((k for k in ("observer", "options") if msg.startswith(f"Role.{k}")),
                            "dynamic"), msg) from None
    if dyn is True:
        try:
            get_observer(d["observer"], spec, **dict(options))
        except (TypeError, ValueError) as e:  # an unknown name; an option it does not take
            raise bad_meta("observer", f"the run-time observer {d['observer']!r} with options "
                                       f"{dict(options)} cannot be built for {spec}: "
                                       f"{e}") from None


#: what save writes of a role beside its tensors
_ROLE_KEYS = ("spec", "observer", "requested", "dynamic", "options", "shape", "fingerprint")


def _role_meta(d, bad_meta, role):
    """The JSON half of a role, checked: ``(spec, dynamic, options, shape)``."""
    if not isinstance(d, dict):
        raise bad_meta("", f"expected a dict, got {type(d).__name__}")
    for k in ("spec", "observer", "requested", "dynamic", "shape"):
        if k not in d:
            raise bad_meta(k, "missing")
    for k in d:  # (a misspelt "fingerprint" would leave the model unchecked without a word)
        if k not in _ROLE_KEYS:
            raise bad_meta(k, f"unknown key (a role holds {', '.join(_ROLE_KEYS)})")
    try:
        spec = QuantSpec.from_dict(d["spec"])
    except (TypeError, ValueError) as e:
        raise bad_meta("spec", str(e)) from None
    dyn = d["dynamic"]
    if not (dyn is True or dyn is False or dyn == "local"):
        raise bad_meta("dynamic", f"expected true, false or \"local\", got {dyn!r}")
    for k in ("observer", "requested"):
        if not isinstance(d[k], str):
            raise bad_meta(k, f"expected a string, got {d[k]!r}")
    options = d.get("options", {})
    if not isinstance(options, dict):
        raise bad_meta("options", f"expected a dict, got {options!r}")
    try:  # as a recipe reads them: JSON's lists back as the tuples they were
        options = role_options(options)
    except ValueError as e:
        raise bad_meta("options", str(e)) from None
    shape = d["shape"]
    if shape is not None and not (isinstance(shape, list) and all(
            type(n) is int and n >= 0 for n in shape)):
        raise bad_meta("shape", f"expected null or a list of sizes, got {shape!r}")
    shape = None if shape is None else tuple(shape)
    if shape is None and role == "weight" and dyn is False:
        # calibration records it: without it the scales' shape would go unchecked
        raise bad_meta("shape", "null, but a static weight role records the calibrated "
                                "weight shape (a list of sizes) its scales are checked against")
    if shape is not None:
        try:
            spec.layout.check(shape)
        except ValueError as e:
            raise bad_meta("shape", str(e)) from None
    return spec, dyn, options, shape


def _tensor_reader(tensors, key, dyn, bad_tensor, used):
    """``get(field, dtype, ...)``: the role's tensor ``key/field``, checked (dtype, finite,
    sign); its key joins ``used``."""

    def get(field, dtype, *, required=False, positive=False, nonneg=False):
        name = f"{key}/{field}"
        t = tensors.get(name)
        if t is None:
            if required:
                raise bad_tensor(name, f"missing (dynamic={dyn!r} needs it)")
            return None
        used.add(name)
        if t.dtype != dtype:
            raise bad_tensor(name, f"dtype {t.dtype} (expected {dtype}, as save writes it)")
        if dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            raise bad_tensor(name, "holds NaN or inf")
        if positive and not bool((t > 0).all()):
            raise bad_tensor(name, f"must be > 0, got min {float(t.min())}")
        if nonneg and not bool((t >= 0).all()):
            raise bad_tensor(name, f"must be >= 0, got min {float(t.min())}")
        return t

    return get


@functools.lru_cache(maxsize=256)
def _written(spec: QuantSpec) -> QParams:
    """The qparams the one formula gives ``spec`` (on an all-zero range): the dtypes save
    writes for it, and a symmetric spec's zero point (0, or mid-range for unsigned formats)."""
    return qparams_from_range(torch.zeros(1), torch.zeros(1), spec)


def _load_device(device) -> torch.device:
    """``load``'s ``device``, or the ``ValueError`` naming it (safetensors' own error would
    blame the file)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load: device {device!r} is not a torch device ({e})") from None
    if dev.type == "meta":
        raise ValueError("load: device 'meta' holds no values, and load checks them; load to "
                         "'cpu' (the default), apply moves the qparams to the model's device")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"load: device {device!r}: CUDA is not available here")
    return dev


def _scale_shape(spec, shape) -> tuple[int, ...] | None:
    """The shape of a role's scales: the layout's qparam shape on the calibrated weight shape;
    a per-tensor role has one value whatever it saw (``(1,)``, or stored as a scalar); None
    where no shape was recorded (activations)."""
    if isinstance(spec.layout, Tensor):
        return (1,)
    return None if shape is None else tuple(spec.layout.qparam_shape(shape))


def _role_qparams(get, key, spec, shape, bad_tensor) -> QParams:
    """The stored qparams of a static role, checked against its spec."""
    ref = _written(spec)
    scale = get("scale", ref.scale.dtype, required=True, positive=True)
    want = _scale_shape(spec, shape)
    units = None if want is None else math.prod(want)
    zp = get("zero_point", ref.zero_point.dtype, required=True)
    if zp.shape != scale.shape:
        raise bad_tensor(f"{key}/zero_point", f"shape {tuple(zp.shape)} differs from the "
                                              f"scale's {tuple(scale.shape)}")
    if zp.numel() and not bool(((zp >= spec.qmin) & (zp <= spec.qmax)).all()):
        raise bad_tensor(f"{key}/zero_point", f"outside the code range [{spec.qmin}, "
                                              f"{spec.qmax}] of {spec}")
    if spec.symmetric and not bool((zp == int(ref.zero_point)).all()):  # on any device
        raise bad_tensor(f"{key}/zero_point", f"{spec} is symmetric: every zero point is "
                                              f"{int(ref.zero_point)}")
    if units is not None and scale.numel() != units:
        where = "has one unit" if shape is None else f"on shape {shape} has {units} units"
        raise bad_tensor(f"{key}/scale", f"{scale.numel()} values, but {spec.layout} {where}")
    if want is not None and tuple(scale.shape) != want and not (want == (1,) and not scale.dim()):
        on = "" if shape is None else f" on shape {shape}"
        raise bad_tensor(f"{key}/scale", f"shape {tuple(scale.shape)}, but {spec.layout}{on} "
                                         f"has scales of shape {want} (the same values in "
                                         f"another shape would quantize other units)")
    _check_encoded(scale, spec, key, bad_tensor)
    return QParams(scale, zp, _global_scale(get, key, spec, ref, bad_tensor))


def _check_encoded(scale, spec, key, bad_tensor) -> None:
    """Every stored scale is one its encoding holds (an edited 0.3 in an MXFP4 folder loaded
    and was applied)."""
    off = not_encoded(scale, spec.scale)
    if bool(off.any()):
        raise bad_tensor(f"{key}/scale", f"holds {float(scale[off][0])!r}, a value its "
                                         f"{spec.scale} encoding cannot store")


def _global_scale(get, key, spec, ref, bad_tensor) -> torch.Tensor | None:
    """NVFP4's one global scale. Not read under a spec without one, so that a stored one
    is refused as a stray tensor (QDQ would divide the scales by it)."""
    if ref.global_scale is None:
        return None
    gs = get("global_scale", ref.global_scale.dtype, required=True, positive=True)
    if gs.numel() != 1:
        raise bad_tensor(f"{key}/global_scale", f"expected one value, got {gs.numel()}")
    return gs
