"""Read a compressed-tensors checkpoint back into a :class:`~quantscope.calibration.Calibration`.

Whoever wrote it (quantscope's exporter, llm-compressor), the folder's
``quantization_config`` says which modules carry which ``QuantizationArgs``; the modules are
matched as compressed-tensors' ``match_named_modules`` matches them (:mod:`.ct_match`) on
the model built from ``config.json`` on the meta device (no weights allocated), a module
several groups match read in the one group compressed-tensors gives it
(:func:`.ct_match.precedence`), and its tensors are decoded by compressed-tensors' own
compressor (``decompress``: fp8 and E8M0 scales to float, packed zero points to integers).
The args become quantscope specs
(:func:`~quantscope.compat.llmcompressor.llmcompressor_spec`, the one translation: MX is
E8M0 ``even``, compressed-tensors' run-time rule for MXFP4 and MXFP6 E2M3; for MXFP8 it
rounds the block amax with fp4's mantissa where quantscope uses e4m3's, said in a warning
where an MXFP8 role computes its scales at run time), the tensors
:class:`~quantscope.qparams.QParams`, so ``calibration.apply(float_model)`` runs the model as
the checkpoint does, and the report and compare tools work on it.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

from .._checks import check_path
from .._versions import require
from ..comm import main_global_rank
from ..compat.llmcompressor_spec import filled_g_idx, llmcompressor_spec
from ..layout import Block, Group
from ..qparams import QParams
from ..scales import nvfp4_global_scale
from ..spec import QuantSpec
from .atomic_swap import read_unchanged
from .ct_match import match_named, matched, precedence, winners
from .experts import disk_to_module, fuse_expert_states, unfuse_for_reading
from .read_checks import (
    SCALE_LEAVES,
    check_kv_scheme,
    compressor,
    exact_pattern,
    fmt_name,
    kv_scale_layer,
    load_checked_tensors,
    missing_zero_point,
    neutral_qparams,
    parse_quant_config,
    read_quant_config,
    refuse_not_run,
    rewriting_modifiers,
    scale_problem,
    storage_problem,
    unexpected_qparam,
    zero_point_problem,
)
from .read_refusals import KV_SCALE, refuse_attention_groups, refuse_unread
from .registry import register_reader

__all__ = ["read_compressed_tensors"]

_ROLE = {"weights": "weight", "input_activations": "input", "output_activations": "output"}


def _global_amax(gs: torch.Tensor, spec: QuantSpec, where: str) -> torch.Tensor:
    """An amax whose NVFP4 global scale is ``gs`` (``448 * 6 / amax`` inverted, then nudged by
    ulps where float32 does not round-trip). A scale that no float32 amax gives (a bf16
    model's: llm-compressor computes it in bf16) reads as the nearest one, with a warning."""
    gs = gs.float().reshape(())
    one, top = torch.tensor([1.0, torch.finfo(torch.float32).max], dtype=torch.float32)
    amax = (nvfp4_global_scale(one, spec.format) / gs).reshape(())
    if not bool(torch.isfinite(amax)):  # a tiny scale: save() would write an amax load refuses
        least = nvfp4_global_scale(top, spec.format)
        raise ValueError(f"from_compressed_tensors: {where} = {float(gs)!r} gives an amax of "
                         f"inf (below {float(least)!r}, the global scale of float32's "
                         f"largest amax)")
    near = None
    for _ in range(8):
        got = nvfp4_global_scale(amax, spec.format)
        if torch.equal(got, gs):
            return amax
        if near is None or abs(float(got - gs)) < abs(float(near[1] - gs)):
            near = (amax, got)
        amax = torch.nextafter(amax, amax * 2 if got > gs else amax / 2)
    warnings.warn(f"from_compressed_tensors: {where}: no float32 amax gives the global scale "
                  f"{float(gs)!r} (one computed in bf16?); read as {float(near[1])!r}, the "
                  f"nearest quantscope's formula gives: a few run-time block scales may round "
                  f"otherwise than the runtime's", stacklevel=2)
    return near[0]


def _meta_model(path: str, config: dict, tensors: int):
    """``(model, experts)``: the float skeleton ``config.json`` describes, on the meta
    device, given the per-expert modules the exporter writes (``experts``:
    :func:`unfuse_for_reading`'s record); no larger than ``tensors`` tensors can hold."""
    from ..calibration.run.hf_loader import (
        ConfigTooLarge,
        load_config,
        model_class,
        parameter_budget,
    )

    where = f"from_compressed_tensors: {os.path.join(path, 'config.json')}"
    cls = model_class(config.get("architectures") or [], where)
    cfg = load_config(path, "from_compressed_tensors")  # its errors name the file
    cfg.quantization_config = None  # build the plain float skeleton; nothing is loaded
    with parameter_budget(tensors, where):
        try:
            with torch.device("meta"):
                model = cls(cfg)
        except ConfigTooLarge:
            raise
        except Exception as e:  # noqa: BLE001 -- a damaged config fails deep in transformers
            # (its strict dataclasses, KeyError on a rope type, AttributeError on a dtype)
            raise ValueError(f"{where}: transformers cannot build {cls.__name__} from it "
                             f"({type(e).__name__}: {e})") from None
        return model, unfuse_for_reading(model)


def _read_kv_cache(args, tensors, states, model, cfg_path):
    """The KV cache's ``key`` / ``value`` states from ``<attention>.k_scale`` / ``v_scale``
    (into ``states``); returns the recipe's ``kv_cache`` Role (None without a scheme). Each
    attention layer of ``model`` with one of the two scales must have both: the other
    cache would run in float without a word."""
    from ..calibration.recipe import Role
    from ..calibration.results.result import RoleState
    from ..calibration.structure.kv_cache import attention_modules

    if args is None:
        return None
    check_kv_scheme(args, f"from_compressed_tensors: {cfg_path}")
    modules, attention = dict(model.named_modules()), attention_modules(model)
    spec = llmcompressor_spec(args, "input")
    observer = args.observer or "minmax"
    qshape = spec.layout.qparam_shape((1, 1))
    read = {}
    for key, value in tensors.items():
        name = key.rpartition(".")[2]
        if name in KV_SCALE:
            layer = kv_scale_layer(key, modules, attention, "from_compressed_tensors")
            qp = QParams(_qparam(value, qshape, layer, name, spec),
                         torch.zeros(qshape, dtype=torch.int32))
            read.setdefault(layer, {})[KV_SCALE[name]] = RoleState(
                spec, observer, observer, False, qparams=qp)
    unscaled = sorted(set(attention) - set(read))
    if unscaled:  # the runtime quantizes every cache with the one scheme; apply() could not
        raise ValueError(f"from_compressed_tensors: kv_cache_scheme is static but the "
                         f"attention modules {unscaled[:3]}{' ...' if len(unscaled) > 3 else ''}"
                         f" have no k_scale / v_scale")
    for layer, roles in read.items():
        missing = [name for name, role in KV_SCALE.items() if role not in roles]
        if missing:
            raise ValueError(f"from_compressed_tensors: {layer} has no {missing[0]} beside "
                             f"its other KV-cache scale")
        states.setdefault(layer, {}).update(roles)
    return Role(spec, observer)


def _qparam(t: torch.Tensor, qshape, module: str, key: str, spec) -> torch.Tensor:
    """``t`` in quantscope's ``qshape``, which is the shape compressed-tensors writes (a
    per-tensor value: any shape of one element). Another shape, a scale of an integer dtype
    or a zero point that is no integer of the format is refused, never reshaped or cast."""
    if tuple(t.shape) != tuple(qshape) and not t.numel() == 1 == math.prod(qshape):
        raise ValueError(f"from_compressed_tensors: {module}.{key} has shape "
                         f"{list(t.shape)}, expected {list(qshape)}")
    if key.endswith("zero_point"):
        if why := zero_point_problem(f"{module}.{key}", t, spec):
            raise ValueError(f"from_compressed_tensors: {why}")
        return t.to(torch.int32).reshape(qshape)
    if not t.is_floating_point():
        raise ValueError(f"from_compressed_tensors: {module}.{key} is {t.dtype}, not a "
                         f"floating-point scale")
    f = t.float()  # quantscope's scales are float32 (a float64 model's checkpoint holds wider)
    if t.itemsize > 4 and not torch.equal(f.to(t.dtype), t):
        warnings.warn("from_compressed_tensors: float64 scales float32 cannot hold exactly "
                      "are read rounded to float32 (quantscope's qparams are float32): apply() "
                      "differs from the checkpoint's float64 run by that rounding",
                      stacklevel=4)
    return f.reshape(qshape)


def _state(st, role, module, local, args, spec, observer, weight_shape):
    from ..calibration.results.result import RoleState

    dynamic = args.dynamic if args.dynamic in (True, False) else str(args.dynamic)
    if dynamic is True:
        return RoleState(spec, "memoryless_minmax", "memoryless_minmax", True)
    base = {"weight": "weight", "input": "input", "output": "output"}[role]
    get = (lambda n: st.get(f"{base}_{n}"))
    gs = get("global_scale")
    if gs is None and spec.scale.has_global_scale:
        raise ValueError(f"from_compressed_tensors: {module} has no {base}_global_scale")
    if dynamic == "local":
        return RoleState(spec, observer, observer, "local",
                         global_amax=_global_amax(_qparam(gs, (1,), module,
                                                          f"{base}_global_scale", spec), spec,
                                                  f"{module}.{base}_global_scale"))
    scale = get("scale")
    if scale is None:
        raise ValueError(f"from_compressed_tensors: {module} has no {base}_scale")
    shape = weight_shape if role == "weight" else (1, local)
    qshape = spec.layout.qparam_shape(shape)
    zp = get("zero_point")
    if zp is not None and role != "weight" and zp.dtype != args.zp_dtype:  # the weight's:
        # storage_problem, packed or not
        raise ValueError(f"from_compressed_tensors: {module}.{base}_zero_point is {zp.dtype}, "
                         f"but compressed-tensors stores the config's {role} zero points "
                         f"({spec}) as {args.zp_dtype}")
    qp = QParams(_qparam(scale, qshape, module, f"{base}_scale", spec),
                 torch.zeros(qshape, dtype=torch.int32) if zp is None else
                 _qparam(zp, qshape, module, f"{base}_zero_point", spec),
                 None if gs is None else _qparam(gs, (1,), module, f"{base}_global_scale",
                                                 spec))
    return RoleState(spec, observer, observer, False, qparams=qp,
                     shape=tuple(weight_shape) if role == "weight" else None)


def _ct_unpackable(stored: dict) -> dict:
    """``stored`` with a one-row packed zero point (a layer of <= 8 outputs, Qwen2-MoE's
    ``shared_expert_gate``) laid out column-first: compressed-tensors 0.20.1 unpacks it
    through a transposed view that it cannot reinterpret as bytes ("self.stride(-1) must be
    1"); the same values in that layout unpack (0.19 unpacks either)."""
    zp = stored.get("weight_zero_point")
    if zp is None or zp.dtype != torch.int32 or zp.dim() != 2 or zp.shape[0] != 1:
        return stored
    column_first = torch.empty_strided(zp.shape, (1, 1), dtype=zp.dtype).copy_(zp)
    return {**stored, "weight_zero_point": column_first}


def _decompress(name, stored, fmt, scheme, spec, wshape) -> dict:
    """compressed-tensors' decoding of a module's weight tensors. Its refusals name no tensor
    ("Expected torch.int32 but got torch.int8", a RuntimeError on a packed zero point of other
    rows): the tensor unlike what it writes is found on neutral qparams (storage_problem)."""
    try:
        return compressor(fmt, "format").decompress(_ct_unpackable(stored), scheme)
    except (ValueError, RuntimeError, AssertionError) as e:
        probe = neutral_qparams(stored, spec, wshape)
        why = storage_problem(name, stored, probe, fmt, scheme, spec, wshape) or (
            f"{name}: its tensors are not what the format stores")
        raise ValueError(f"from_compressed_tensors: {why} (compressed-tensors: {e})") from None


def _decoded_scale_problem(name: str, local: dict) -> str | None:
    """Why a decoded scale of ``name`` cannot be used: the stored ones were checked as stored
    (:func:`.read_checks.load_checked_tensors`), these as compressed-tensors decodes them
    (E8M0 to float)."""
    for key, value in local.items():
        why = scale_problem(key, value) if key in SCALE_LEAVES else None
        if why:
            return f"{name}: {why}"
    return None


def _moved_columns(stored: dict, specs: dict) -> str | None:
    """Why a stored ``<role>_g_idx`` is refused (-1s and column order read as plain groups)."""
    for leaf, g in stored.items():
        lay = getattr(specs.get(leaf.removesuffix("_g_idx")), "layout", None)
        try:
            if leaf.endswith("_g_idx") and filled_g_idx(g) is not None and not (
                    isinstance(lay, (Group, Block)) and Group(lay.size, -1, g).order is None):
                return (f"{leaf} moves columns (activation order) of {lay}: quantscope reads "
                        f"column-order groups only (compressed-tensors 0.20 reads no g_idx)")
        except ValueError as e:
            return f"{leaf} gives no column a group of {lay} ({e})"


def _read_module(name, wshape, stored, roles, specs, observers, fmt, scheme) -> dict:
    """One module's role states from its ``stored`` tensors (local names); the weight's are
    decoded by compressed-tensors' compressor after checking they are what it writes."""
    local = stored
    if "weight" in roles and "weight_scale" not in stored:
        raise ValueError(f"from_compressed_tensors: {name}: its group quantizes the weight, but "
                         f"no weight_scale is stored (only {sorted(stored)}): a layer kept in "
                         f"float that the config's ignore does not name?")
    why = missing_zero_point(name, stored, roles, specs)
    if why:
        raise ValueError(f"from_compressed_tensors: {why}")
    if "weight" in roles:  # the shapes first: nothing allocated of the size config.json says
        spec, probe = specs["weight"], neutral_qparams(stored, specs["weight"], wshape, "meta")
        why = storage_problem(name, stored, probe, fmt, scheme, spec, wshape, meta=True)
        if why:
            raise ValueError(f"from_compressed_tensors: {why}")
        local = _decompress(name, stored, fmt, scheme, spec, wshape)
        why = storage_problem(name, stored, local, fmt, scheme, spec, wshape) or \
            _decoded_scale_problem(name, local)
        if why:
            raise ValueError(f"from_compressed_tensors: {why}")
    return {r: _state(local, r, name, wshape[-1] if r == "input" else wshape[0], roles[r],
                      specs[r], observers[r], wshape) for r in roles}


def _group(gname, scheme, qconfig, cfg_path):
    """One config group checked: ``(rule, roles, specs, observers, fmt)``, the rule with the
    group's roles (its targets as written: :func:`.ct_match.precedence` orders them)."""
    from ..calibration.recipe import Role, Rule

    where = f"from_compressed_tensors: {cfg_path}: config_groups.{gname}"
    roles = {_ROLE[k]: getattr(scheme, k) for k in _ROLE if getattr(scheme, k) is not None}
    try:  # args compressed-tensors accepts and quantscope has no format for (num_bits 99)
        specs = {r: llmcompressor_spec(a, r) for r, a in roles.items()}
        observers = {r: (a.observer or "minmax") for r, a in roles.items()}
        rule = Rule(tuple(scheme.targets), **{
            r: Role(specs[r], "memoryless_minmax" if a.dynamic is True else observers[r],
                    a.dynamic if a.dynamic in (True, False) else str(a.dynamic))
            for r, a in roles.items()})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    fmt = scheme.format or qconfig.format
    compressor(fmt, f"{where}.format")  # a known format, or an error naming the field
    return rule, roles, specs, observers, fmt


def _read_layer(name, module, gname, part, qconfig, layers, model, cfg_path):
    """The role states of the layer ``name``, read as its group ``gname`` (``part``:
    :func:`_group`) from its tensors in ``layers`` (:func:`_by_layer`)."""
    where = f"from_compressed_tensors: {cfg_path}: config_groups.{gname}"
    _, roles, specs, observers, fmt = part
    scheme = qconfig.config_groups[gname]
    local = dict(layers.get(name, {}))
    if not local:
        raise ValueError(f"{where}: layer {name} has no tensor in the folder"
                         f"{_stray(layers, model)}")
    keep = {n for n, _ in module.named_parameters(recurse=False)} | \
        {n for n, _ in module.named_buffers(recurse=False)} | \
        (set(KV_SCALE) if qconfig.kv_cache_scheme is not None else set())
    try:
        why = unexpected_qparam(local, roles, specs, keep) or _moved_columns(local, specs)
        if why:
            raise ValueError(f"from_compressed_tensors: {name}: {why}")
        return _read_module(name, tuple(module.weight.shape), local, roles, specs,
                            observers, fmt, scheme)
    except ValueError as e:  # a missing or misshapen tensor: name the files it is not in
        tensor_files = os.path.join(os.path.dirname(cfg_path), "*.safetensors")
        msg = str(e).removeprefix("from_compressed_tensors: ")
        raise ValueError(f"from_compressed_tensors: {tensor_files}: {msg}") from None
    # compressed-tensors checks its inputs with assert (a missing zero point)
    except (KeyError, AttributeError, RuntimeError, TypeError, IndexError,
            AssertionError) as e:
        raise ValueError(f"{where}: layer {name}: its tensors do not fit the group's "
                         f"scheme ({type(e).__name__}: {e})") from None


def _by_layer(tensors: dict) -> dict:
    """``{layer: {leaf: tensor}}``: the folder's tensors ``<layer>.<leaf>`` by layer, once
    (a scan of them all per layer is quadratic in layers)."""
    layers = {}
    for key, value in tensors.items():
        layer, _, leaf = key.rpartition(".")
        layers.setdefault(layer, {})[leaf] = value
    return layers


def _stray(layers, model) -> str:
    """A note naming a tensor of the folder (``layers``: :func:`_by_layer`) that no module of
    ``model`` holds, if any: the folder names its layers otherwise than the model built from
    config.json does."""
    modules = dict(model.named_modules())
    stray = next((f"{layer}.{next(iter(leaves))}" for layer, leaves in layers.items()
                  if layer not in modules), None)
    return "" if stray is None else (
        f"; the folder's {stray!r} names no module of the model built from config.json "
        f"(another toolkit's layer names?)")


def _module_names(model, tensors: dict, qconfig) -> dict:
    """The folder's names as the skeleton's modules have them: the exporter writes
    transformers' disk names (Mixtral's ``block_sparse_moe``), in tensors, targets and
    ignore alike; returns the renamed tensors (``qconfig`` is renamed in place)."""
    rename = disk_to_module(model)
    if not rename:
        return tensors
    qconfig.ignore = [rename.get(n, n) for n in qconfig.ignore or ()]
    for scheme in qconfig.config_groups.values():
        scheme.targets = [rename.get(n, n) for n in scheme.targets]
    out = {}
    for key, value in tensors.items():
        layer, _, leaf = key.rpartition(".")
        out[f"{rename[layer]}.{leaf}" if layer in rename else key] = value
    return out


def _warn_run_time_mx(states, path) -> None:
    """Warn where an MX role computes its E8M0 scales at run time with a rounding other than
    compressed-tensors' (0.20 ``generate_mx_scales``: the block amax rounded to fp4's 1-bit
    mantissa, E2M3's 3 bits for 6-bit elements; quantscope's ``even`` uses the element's)."""
    odd = sorted({f.name for roles in states.values() for st in roles.values()
                  if st.dynamic is True and st.spec.scale.kind == "e8m0"
                  and getattr(f := st.spec.format, "mbits", 1)
                  != (3 if f.ebits + f.mbits == 5 else 1)})  # 6-bit: sign + 5
    if odd:
        warnings.warn(f"from_compressed_tensors: {path}: {', '.join(odd)} MX roles compute "
                      f"their scales at run time; compressed-tensors rounds each block's amax "
                      f"to fp4's mantissa first (E2M3's for 6-bit elements), quantscope's "
                      f"apply() to the element's own: where they differ, a block's scale is "
                      f"twice theirs", stacklevel=3)


def _rewritten(path: str, record) -> bool:
    """Whether the checkpoint's weights were changed before they were rounded (its
    ``recipe.yaml`` names GPTQ, AWQ, SmoothQuant ...; quantscope's record says smoothed),
    warning so: its qparams do not run the original float model as the checkpoint does."""
    rewriting = [f"{m} (its recipe.yaml)" for m in rewriting_modifiers(path)]
    if isinstance(record, dict) and record.get("smoothed"):
        rewriting.append("quantscope's SmoothQuant (its config's quantscope record)")
    if rewriting:
        warnings.warn(
            f"from_compressed_tensors: {path} was made by {', '.join(rewriting)}, which "
            f"changes the weights before quantizing them: these qparams applied to the "
            f"original float model do not run it as the checkpoint does; applied to the "
            f"checkpoint loaded decompressed (info['model']) they do", stacklevel=3)
    return bool(rewriting)


@register_reader("compressed-tensors")
def read_compressed_tensors(path):
    """The :class:`~quantscope.calibration.Calibration` a compressed-tensors folder holds.

    ``calibration.apply(model)`` on the float model runs it as the checkpoint does where the
    checkpoint's weights are the float ones rounded with these qparams in float32
    (quantscope's exports, llm-compressor's ``QuantizationModifier`` on a float32 model; on a
    bfloat16 / float16 one it divides in that dtype, and some codes differ by one: apply
    them to the checkpoint loaded decompressed instead): ``info["model"]`` is the source model the
    exporter recorded, else ``path`` (transformers loads it decompressed given
    ``quantization_config=CompressedTensorsConfig(run_compressed=False)``). GPTQ, AWQ or
    SmoothQuant change the weights before rounding them (the folder's ``recipe.yaml`` names
    the modifier, quantscope's record says ``smoothed``): their qparams are read all the
    same, with a warning, and ``info["model"]`` is ``path``.
    """
    from ..calibration.recipe import Recipe
    from ..calibration.results.result import Calibration

    for dist in ("compressed-tensors", "transformers"):
        require(dist, "from_compressed_tensors")
    path = check_path("from_compressed_tensors", path)
    # the config and the tensors of one version of the folder, though another process
    # exports over it meanwhile
    cfg_path, config, qc, tensors = read_unchanged(path, "from_compressed_tensors", lambda: (
        *read_quant_config(path, "from_compressed_tensors"),
        load_checked_tensors(path, "from_compressed_tensors")))
    qconfig = parse_quant_config(cfg_path, qc, "from_compressed_tensors")
    refuse_not_run(cfg_path, qc, "from_compressed_tensors")
    model, experts = _meta_model(path, config, len(tensors))
    tensors = _module_names(model, tensors, qconfig)
    groups = {g: _group(g, s, qconfig, cfg_path) for g, s in qconfig.config_groups.items()}
    for g, s in qconfig.config_groups.items():
        if next(match_named(model, s.targets, qconfig.ignore), None) is None:
            raise ValueError(f"from_compressed_tensors: {cfg_path}: config_groups.{g}.targets: "
                             f"{s.targets} match no layer of the model")
    rules, of = precedence(qconfig, groups, model)
    # the config's names are exact, quantscope's plain patterns globs: "[", "*", "?" escaped
    ignore = tuple(exact_pattern(n) for n in qconfig.ignore or ())
    layers = _by_layer(tensors)
    picked = list(winners(qconfig, rules, ignore, of, model))
    refuse_attention_groups(f"from_compressed_tensors: {cfg_path}",  # (roles taken or not)
                            [m[:3] for m in matched(qconfig, rules, ignore, of, model)], model,
                            qconfig)
    states = {name: _read_layer(name, module, g, groups[g], qconfig, layers, model, cfg_path)
              for name, module, g in picked}
    grouped = set(states)
    kv_cache = _read_kv_cache(qconfig.kv_cache_scheme, tensors, states, model, cfg_path)
    if not states:
        raise ValueError(f"from_compressed_tensors: no module of {path} matches the config "
                         f"groups' targets")
    refuse_unread(tensors, grouped, kv_cache, path)
    _warn_run_time_mx(states, path)
    # the per-expert states back onto the model's 3-D experts, as calibrate named them
    states = fuse_expert_states(experts, states, f"from_compressed_tensors: {path}")
    recipe = Recipe(tuple(rules), ignore, "compressed-tensors", kv_cache=kv_cache)
    record = config.get("quantscope")
    source = record.get("model") if isinstance(record, dict) else None
    if _rewritten(path, record):
        source = None  # the float source runs otherwise: the checkpoint is the model
    info = {"model": source if isinstance(source, str) and os.path.isdir(source) else path,
            "checkpoint": path, "format": fmt_name(qconfig.format)}
    # in a process group every rank reads the checkpoint: one writer, the default group's rank 0
    return Calibration(recipe, states, os.path.basename(os.path.normpath(path)), info=info,
                       writer_rank=main_global_rank())

