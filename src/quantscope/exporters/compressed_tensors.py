"""Export a calibration as a compressed-tensors checkpoint (what vLLM and transformers load).

The translation, layer by layer: each :class:`~quantscope.calibration.RoleState` becomes a
compressed-tensors ``QuantizationArgs`` (:func:`quant_args`; anything the format cannot express
is a ``ValueError`` naming the layer and the feature, raised before anything is written), the
layer gets compressed-tensors' own qparam parameters (``initialize_module_for_quantization``)
holding quantscope's scales as they are, and compressed-tensors' ``ModelCompressor`` packs the
weights (int8 ``int-quantized``, int4 ``pack-quantized``, fp8 ``float-quantized``,
``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``): no bit is packed here. The model's own
``save_pretrained`` writes the (sharded) safetensors and ``ModelCompressor.update_config`` the
``quantization_config``; the source model folder's tokenizer, generation config and chat
template (``EXPORT_EXTRAS``, nothing else) are copied beside them. All of it happens on a deep
copy of the model inside :func:`~quantscope.exporters.atomic.atomic_dir`: the caller's model is
untouched and a failure leaves nothing behind.

Conventions (the same numbers on both sides, checked in
tests/export/test_export_compressed_tensors.py): an int or fp8 scale is the scale that multiplies a
code; NVFP4's ``weight_scale`` is the e4m3 block scale and ``weight_global_scale`` the fp32 global
scale ``448 * 6 / amax``, the scale that runs being ``block / global`` (quantscope's
:class:`~quantscope.qparams.QParams` ``scale`` / ``global_scale``); ``input_global_scale`` is that
global scale of the calibrated activation amax; MX scales are powers of two, stored as E8M0
exponents.
"""

from __future__ import annotations

import copy
import json
import warnings

import torch
from torch import nn

from .._checks import check_bool
from .._versions import require
from ..calibration.run.disk_names import checkpoint_names, split_names
from ..calibration.structure.kv_cache import attention_modules
from ..calibration.structure.placement import check_placement, held_weight, unhooked
from ..calibration.structure.tied import tied_weights
from ..formats import FloatFormat, IntFormat, named
from ..layout import Block, Channel, Group, Tensor, Tile, Token
from ..scales import not_encoded, nvfp4_global_scale
from .atomic import atomic_dir, check_writable_target
from .consistency import warn_fused_problems
from .ct_compress import annotate, check_shard_size, compress, ct_compressor, save_here
from .experts import unfuse_experts
from .read_checks import kv_scheme_problem
from .registry import register
from .serving import embedding_layers, warn_unservable
from .source_folder import check_model_path, copy_extras, loaded_from, source_dir

__all__ = ["check_static_weights", "export_compressed_tensors", "quant_args"]

KIND = "compressed-tensors"  # the format name, and the kind of folder it writes (atomic)

_ARG_NAME = {"weight": "weights", "input": "input_activations", "output": "output_activations"}


def _ct():
    require("compressed-tensors", "export to compressed-tensors")


class _Lossy:
    """Collects what cannot be written exactly: an error, or with ``allow_lossy`` a note."""

    def __init__(self, allow: bool):
        self.allow = allow
        self.notes: list[str] = []

    def __call__(self, layer: str, role: str, feature: str, change: str) -> None:
        msg = f"layer {layer!r} {role}: {feature}"
        if not self.allow:
            raise ValueError(f"export compressed-tensors: {msg}; compressed-tensors cannot "
                             f"express it (allow_lossy=True / --allow-lossy would {change})")
        self.notes.append(f"{msg}: {change}")


def _unsupported(layer, role, feature):
    return ValueError(f"export compressed-tensors: layer {layer!r} {role}: {feature} has no "
                      f"compressed-tensors equivalent")


def quant_args(state, layer: str, role: str, lossy: _Lossy | None = None):
    """The compressed-tensors ``QuantizationArgs`` of one :class:`RoleState`.

    Raises ``ValueError`` naming ``layer``, ``role`` and the feature when the spec has no
    equivalent (unsigned, narrow or custom-range integers; fp8 e5m2 / fp6; power-of-two or
    fp16 scales, unless ``lossy`` allows writing their values as plain scales; layouts other
    than tensor, channel of a weight's rows, groups along the last axis in column order (no
    ``g_idx`` that moves columns), token, NVFP4 / MX blocks, weight tiles).
    """
    _ct()
    from compressed_tensors.quantization import QuantizationArgs

    lossy = lossy or _Lossy(False)
    kw = {"symmetric": state.spec.symmetric, **_element_args(state.spec, layer, role)}
    if state.dynamic == "local":
        kw["dynamic"] = "local"
    elif state.dynamic:
        kw["dynamic"] = True
    kw.update(_strategy_args(state, layer, role, lossy))
    if not state.dynamic or state.dynamic == "local":
        kw["observer"] = state.observer
    return QuantizationArgs(**kw)


def _element_args(spec, layer: str, role: str) -> dict:
    """``num_bits`` and ``type`` of the element format (full signed integers up to 8 bits,
    fp8 e4m3, fp4 e2m1: what compressed-tensors' runtimes unpack)."""
    fmt = spec.format
    if isinstance(fmt, IntFormat):
        if not fmt.signed or fmt.narrow or spec.quant_min is not None \
                or spec.quant_max is not None:
            raise _unsupported(layer, role, f"integer format {fmt.name} with codes "
                                            f"[{spec.qmin}, {spec.qmax}] (only full signed ranges)")
        if fmt.bits > 8:
            raise _unsupported(layer, role, f"{fmt.name} (at most 8 bits)")
        return {"num_bits": fmt.bits, "type": "int"}
    if isinstance(fmt, FloatFormat) and named(fmt) and fmt.name in ("fp8_e4m3", "fp4_e2m1"):
        return {"num_bits": 8 if fmt.name == "fp8_e4m3" else 4, "type": "float"}
    raise _unsupported(layer, role, f"element format {fmt.name}")


def _strategy_args(state, layer: str, role: str, lossy: _Lossy) -> dict:
    """The strategy (and its group size, block or scale dtypes): NVFP4 and MX blocks by their
    scale encoding, every other layout with fp32 scales."""
    spec, lay, enc = state.spec, state.spec.layout, state.spec.scale
    fmt = spec.format
    if enc.kind == "fp8_e4m3":  # NVFP4: e4m3 block scales under an fp32 global scale
        if not (fmt.name == "fp4_e2m1" and isinstance(lay, Block) and lay.size == 16
                and _last_axis(state, role)):
            raise _unsupported(layer, role, f"{spec} (fp8 block scales: NVFP4 only)")
        _whole_blocks(state, layer, role, 16)
        if state.dynamic is True:  # vLLM's NVFP4 layer reads a calibrated input_global_scale
            raise _unsupported(layer, role, f"{spec} with its global scale from each call (NVFP4 "
                               f"activations run with a calibrated global scale: dynamic='local'; "
                               f"keep_float(mode='float') leaves such an input in float)")
        return {"strategy": "tensor_group", "group_size": 16, "scale_dtype": torch.float8_e4m3fn,
                "zp_dtype": torch.float8_e4m3fn}
    if enc.kind == "e8m0":  # MX: E8M0 exponents, group 32
        if not (fmt.name == "fp4_e2m1" and isinstance(lay, Block) and lay.size == 32
                and _last_axis(state, role)):
            raise _unsupported(layer, role, f"{spec} (MX: mxfp4 blocks of 32 only)")
        _whole_blocks(state, layer, role, 32)
        if state.dynamic and enc.mode != "even":
            # the runtime computes activation scales itself, with the 'even' rule
            lossy(layer, role, f"run-time MX scales with the E8M0 {enc.mode!r} rule",
                  "let the runtime use compressed-tensors' 'even' rule")
        return {"strategy": "group", "group_size": 32, "scale_dtype": torch.uint8,
                "zp_dtype": torch.uint8}
    if fmt.name == "fp4_e2m1":  # its fp4 compressors write e4m3 or e8m0 scales, nothing else
        raise _unsupported(layer, role, f"{spec} with {enc} scales (compressed-tensors writes "
                           f"fp4 only as NVFP4: fp8 e4m3 scales of blocks of 16 under an fp32 "
                           f"global scale, or as MXFP4: e8m0 scales of blocks of 32)")
    if enc.kind != "fp32":
        lossy(layer, role, f"{enc} scale encoding",
              "store the same scale values as plain float scales, in the model's dtype (the "
              "encoding is not recorded)")
    return _layout_args(state, layer, role)


def _last_axis(state, role: str) -> bool:
    """Whether the groups or blocks run along the last axis, where compressed-tensors puts
    them: -1 or the recorded shape's last (a weight without one: a Linear's, 2-D); axis 1 of a
    ``[batch, seq, hidden]`` input is the sequence."""
    ndim = len(state.shape) if state.shape is not None else 2 if role == "weight" else 0
    return state.spec.layout.axis in (-1, ndim - 1)


def _whole_blocks(state, layer: str, role: str, size: int) -> None:
    """compressed-tensors packs NVFP4 / MX weights in whole blocks of their last axis only."""
    if state.shape is not None and state.shape[-1] % size:
        raise ValueError(f"export compressed-tensors: layer {layer!r} {role}: {state.shape[-1]} "
                         f"columns (shape {tuple(state.shape)}) are not a multiple of the block "
                         f"size {size}; compressed-tensors packs whole blocks (ignore the layer)")


def _layout_args(state, layer: str, role: str) -> dict:
    """The strategy of an fp32-scaled layout, where compressed-tensors has one."""
    lay, shape = state.spec.layout, state.shape
    if isinstance(lay, Tensor):
        return {"strategy": "tensor"}
    if isinstance(lay, Channel) and role == "weight" and shape is not None \
            and len(shape) == 2 and lay.axis % 2 == 0:  # rows: axis 0 or -2
        return {"strategy": "channel"}
    if isinstance(lay, Group) and lay.order is None and _last_axis(state, role):  # in order
        return {"strategy": "group", "group_size": lay.size}
    if isinstance(lay, Token) and state.dynamic is True:
        return {"strategy": "token"}
    if isinstance(lay, Tile) and role == "weight" and shape is not None and len(shape) == 2:
        # partial tiles (last rows or columns) as compressed-tensors pads them: ceil'd scales
        return {"strategy": "block", "block_structure": [lay.rows, lay.cols]}
    raise _unsupported(layer, role, f"layout {lay} (with {state.spec}, dynamic={state.dynamic})")


def _check_module(model: nn.Module, layer: str, roles: dict) -> nn.Module:
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        raise ValueError(f"export compressed-tensors: the model has no module {layer!r} "
                         f"(calibrated on another model?)") from None
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise _unsupported(layer, "module", f"module type {type(module).__name__} "
                                            f"(Linear and Embedding only)")
    st = roles.get("weight")
    if st is not None and st.shape is not None and tuple(module.weight.shape) != st.shape:
        raise ValueError(f"export compressed-tensors: {layer}.weight has shape "
                         f"{tuple(module.weight.shape)}, calibrated with {st.shape}")
    return module


def _tied(model: nn.Module, layers) -> None:
    """A quantized weight another module shares (one Parameter or memory; on the model: a copy's
    .cpu() splits one GPU memory) would be written quantized for one, float for the other."""
    for layer, others in tied_weights(model, layers).items():
        raise _unsupported(layer, "weight", f"a weight tied with {others} "
                                            f"(leave it in float: ignore it in the recipe)")


def _split_on_disk(work: nn.Module, states) -> None:
    """A layer whose weight transformers renames on saving by a rule its other tensors miss
    would be written under two names (PhiMoE's router: ``gate.weight`` beside
    ``router.input_scale``), a checkpoint no loader reads: refuse it."""
    written = {layer: {r for r, st in roles.items() if st.dynamic is not True}  # no tensors
               for layer, roles in states.items()}
    for layer, (weight, other) in split_names(work, written).items():
        raise ValueError(f"export compressed-tensors: layer {layer!r}: transformers saves it "
                         f"under two names (its weight as {weight!r}, its scales as "
                         f"{other!r}), a checkpoint no loader reads; leave it in float (ignore "
                         f"it in the recipe)")


def _fill(module: nn.Module, base: str, state, lossy: _Lossy, layer: str) -> None:
    """Copy ``state``'s qparams into the parameters compressed-tensors registered."""
    if state.dynamic is True:
        return
    values = {}
    if state.dynamic == "local":
        values["global_scale"] = nvfp4_global_scale(state.global_amax, state.spec.format)
    else:
        qp = state.qparams
        _check_encoded(qp.scale, state.spec.scale, layer, base)
        values["scale"] = qp.scale
        values["zero_point"] = qp.zero_point
        if qp.global_scale is not None:
            values["global_scale"] = qp.global_scale
    for field, value in values.items():
        param = getattr(module, f"{base}_{field}", None)
        if param is None:
            if field == "zero_point" and state.spec.symmetric:
                continue
            raise ValueError(f"export compressed-tensors: layer {layer!r} {base}: "
                             f"compressed-tensors registered no {base}_{field}")
        value = value.detach().to(param.device)
        if value.numel() != param.numel():
            raise ValueError(f"export compressed-tensors: layer {layer!r} {base}_{field}: "
                             f"{value.numel()} values for a parameter of shape "
                             f"{tuple(param.shape)}")
        dtype = param.dtype
        if field == "scale" and state.spec.scale.kind == "e8m0":
            # compressed-tensors writes E8M0 bytes from it: float32 holds all 2**-127 ..
            # 2**127; a float16 model's dtype flushed 2**-127 to 0, written as 1.0
            dtype = torch.float32
        cast = _cast(value.reshape(param.shape), dtype, lossy, layer, base, f"{base}_{field}")
        with torch.no_grad():
            param.data = cast


def _cast(value: torch.Tensor, dtype: torch.dtype, lossy: _Lossy, layer: str, role: str,
          name: str) -> torch.Tensor:
    """``value`` in ``dtype``, the dtype the checkpoint's loader holds it in: a value that
    dtype rounds would run as another scale than apply()'s (refused, or under ``allow_lossy``
    rounded with a note); one it turns into 0 or inf is refused even so."""
    cast = value.to(dtype).clone()  # shards own their copy
    _refuse_lost(value, cast, f"layer {layer!r} {name}")
    if not torch.equal(cast.to(value.dtype), value):
        lossy(layer, role, f"{name} not exact in {dtype} (the model's dtype)",
              f"round it to {dtype}")
    return cast


def _refuse_lost(value: torch.Tensor, cast: torch.Tensor, what: str) -> None:
    """A qparam that the model's dtype turns into 0 or inf is no rounding ``allow_lossy`` may
    write (a scale below float16's 2**-24, from a spec's small ``eps``): the checkpoint
    would hold a scale no runtime can divide by, which the reader refuses."""
    lost = ((cast == 0) & (value != 0)) | (cast.isinf() & value.isfinite())
    if bool(lost.any()):
        v = float(value[lost].reshape(-1)[0])
        raise ValueError(f"export compressed-tensors: {what} holds {v!r}, which is "
                         f"{float(cast[lost].reshape(-1)[0])} in {cast.dtype} (the model's "
                         f"dtype); export the model in float32, or calibrate with a spec eps "
                         f"that {cast.dtype} holds")


def _check_encoded(scale: torch.Tensor, encoding, layer: str, base: str) -> None:
    """Refuse a block scale its encoding cannot store: compressed-tensors would write another
    one without a word (an fp8 cast rounds or saturates it, an E8M0 byte wraps 2**-149 to
    2**107), so the checkpoint would not run the scales apply() runs. quantscope's formulas
    never give one; an in-memory edit can."""
    off = not_encoded(scale, encoding) if encoding.is_block else None
    if off is not None and bool(off.any()):
        raise ValueError(f"export compressed-tensors: layer {layer!r} {base}_scale holds "
                         f"{float(scale[off].reshape(-1)[0])!r}, a value its {encoding} "
                         f"encoding cannot store (it would be written as another)")


_KV_SCALE = {"key": "k_scale", "value": "v_scale"}


def _split_kv(states):
    """``(states of the Linear layers, {attention layer: {"key", "value": state}})``."""
    layers, kv = {}, {}
    for layer, roles in states.items():
        cache = {r: st for r, st in roles.items() if r in _KV_SCALE}
        rest = {r: st for r, st in roles.items() if r not in _KV_SCALE}
        if cache:
            kv[layer] = cache
        if rest:
            layers[layer] = rest
    return layers, kv


def _kv_args(kv, lossy):
    """The one ``kv_cache_scheme`` of every layer's key and value (one per checkpoint; fp8, as
    vLLM's cache: it would run an int8 scheme on int8's scales), or None without a KV role."""
    args = {}
    for layer, roles in kv.items():
        if set(roles) != set(_KV_SCALE):
            raise _unsupported(layer, "kv cache", f"roles {sorted(roles)} (key and value both)")
        for role, st in roles.items():
            a = quant_args(st, layer, role, lossy)
            if kv_scheme_problem(a):  # the reader's rule too: what one writes the other reads
                raise _unsupported(layer, role, f"{st.spec} (a static symmetric per-tensor fp8 "
                                                f"KV cache scale: vLLM's k_scale / v_scale)")
            args.setdefault(json.dumps(a.model_dump(mode="json"), sort_keys=True), a)
    if len(args) > 1:
        raise ValueError(f"export compressed-tensors: the KV cache roles differ in scheme "
                         f"({len(args)} kinds); a checkpoint holds one kv_cache_scheme")
    return next(iter(args.values()), None)


def _kv_everywhere(work: nn.Module, kv) -> None:
    """A KV cache calibrated on every cached attention module or on none: the one
    ``kv_cache_scheme`` applies to all of them (compressed-tensors never reads ``ignore``
    for it; vLLM has no per-layer KV dtype), so a module without scales would run its cache
    with an uninitialised (compressed-tensors) or 1.0 (vLLM) scale where apply() keeps it float."""
    missing = sorted(set(attention_modules(work)) - set(kv)) if kv else []
    if missing:
        raise ValueError(f"export compressed-tensors: the KV cache is calibrated, but the "
                         f"attention modules {missing} have no KV-cache scales (ignored in "
                         f"the recipe?); a checkpoint's one kv_cache_scheme quantizes every "
                         f"attention's cache: calibrate the KV cache of all attention layers "
                         f"or of none")


def _groups(states, lossy):
    """``{args triple: [layers]}``: layers with identical quantization share a config group."""
    groups: dict = {}
    for layer, roles in states.items():
        args = tuple((role, quant_args(st, layer, role, lossy))
                     for role, st in sorted(roles.items()))
        key = json.dumps([(r, a.model_dump(mode="json")) for r, a in args], sort_keys=True)
        groups.setdefault(key, (dict(args), []))[1].append(layer)
    return list(groups.values())


def _check_call(calibration, model: nn.Module, overwrite, allow_lossy, model_path,
                max_shard_size, **_) -> None:
    """The arguments' checks that need neither the disk nor a collective (every rank)."""
    for name, flag in (("overwrite", overwrite), ("allow_lossy", allow_lossy)):  # "no": True
        check_bool("export compressed-tensors", name, flag)
    check_model_path(model_path, "export compressed-tensors")
    check_shard_size(max_shard_size, "export compressed-tensors")
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"export compressed-tensors: model must be a transformers "
                        f"PreTrainedModel (it writes a Hugging Face folder), got "
                        f"{type(model).__name__}")
    if not calibration.states:
        raise ValueError("export compressed-tensors: the calibration quantizes no layer")
    check_static_weights(calibration.states)
    check_placement(model, "export compressed-tensors")


def check_static_weights(states) -> None:
    """A checkpoint stores each quantized weight as codes and the scales they were made with:
    a weight whose scales are computed at each call (``dynamic=True``, or ``"local"`` block
    scales) has none to store, and compressed-tensors fails on the missing scale naming no
    layer (a Group layout: ``'NoneType' object has no attribute 'ndim'``). Every layout alike,
    before any work (``quantscope export``: before the model loads)."""
    for layer, roles in states.items():
        st = roles.get("weight")
        if st is not None and st.dynamic is not False:
            raise ValueError(f"export compressed-tensors: layer {layer!r} weight: "
                             f"dynamic={st.dynamic!r} (a run-time weight scale, computed from "
                             f"the weight at each call) has no compressed-tensors equivalent: "
                             f"a checkpoint stores each weight's codes with calibrated scales; "
                             f"calibrate the weight with dynamic=False")


@register(KIND, check=_check_call)
def export_compressed_tensors(calibration, model: nn.Module, path, *, overwrite: bool = False,
                              allow_lossy: bool = False, model_path=None,
                              max_shard_size="5GB") -> str:
    """Write ``calibration`` applied to ``model`` as a compressed-tensors folder at ``path``.

    Args:
        calibration: a :class:`~quantscope.calibration.Calibration` of ``model``.
        model: the float model (a transformers ``PreTrainedModel``); it is not modified.
        path: the output folder; an existing non-empty one is refused unless ``overwrite``.
        allow_lossy: write what compressed-tensors cannot express exactly in its nearest form
            (fp32 values of power-of-two scales, the runtime's MX rule, scales and KV-cache
            scales rounded to a bf16 / fp16 model's dtype) instead of raising;
            what changed is in ``config.json``'s ``quantscope.lossy`` and a warning.
        model_path: the source model folder (with a config.json) whose tokenizer,
            generation config and chat template (``EXPORT_EXTRAS``) are copied (default: the
            folder ``model.config._name_or_path`` names, then ``calibration.info["model"]``).
        max_shard_size: as transformers' ``save_pretrained`` takes it: a number of bytes, or a
            number and a unit (TB, GB, MB, KB: ``"5GB"``); at least one byte.

    Returns the path. Raises ``ValueError`` naming the layer and the feature for anything the
    format cannot express, before anything is written.
    """
    _ct()  # (its arguments were checked on every rank: _check_call)
    path = check_writable_target(path, overwrite=overwrite, what=KIND)  # before the work
    lossy = _Lossy(allow_lossy)
    modules = dict(model.named_modules())  # (MoE experts' per-expert names are not there)
    for layer in (n for n, roles in calibration.states.items() if "weight" in roles):
        if layer in modules:  # before the deepcopy, which a pruned weight fails
            held_weight("export compressed-tensors", layer, modules[layer])
    work = unhooked(copy.deepcopy(model)).cpu()
    # MoE experts under the checkpoint's per-expert names (vLLM's loader reads those)
    states, kv = _split_kv(unfuse_experts(work, calibration.states))
    kv_args = _kv_args(kv, lossy)
    _kv_everywhere(work, kv)
    for layer, roles in states.items():
        _check_module(work, layer, roles)
    _tied(model, [layer for layer, roles in states.items() if "weight" in roles])
    _split_on_disk(work, states)
    groups = _groups(states, lossy)
    source = source_dir(calibration, model, model_path)

    _attach_schemes(work, groups, states, lossy)
    _attach_kv_scales(work, kv, lossy)
    if lossy.notes:
        warnings.warn("export compressed-tensors (allow_lossy): " + "; ".join(lossy.notes),
                      stacklevel=2)
    compressor = ct_compressor(work, kv_args)
    compress(compressor, work)
    copied = []  # their modes stay: a private tokenizer file is not made readable
    with atomic_dir(path, overwrite=overwrite,  # never the source, nor the model's folder
                    inputs=[source, *loaded_from(calibration, model)],
                    keep_modes=copied, what=KIND) as tmp:
        save_here(work, tmp, max_shard_size=max_shard_size)
        compressor.update_config(tmp)
        annotate(tmp, calibration, lossy.notes, source, work)
        warn_unservable(tmp, checkpoint_names(work, embedding_layers(work)).values())
        warn_fused_problems(tmp)
        if source is not None:
            copied += copy_extras(source, tmp)
    return path


def _attach_schemes(work: nn.Module, groups, states, lossy: _Lossy) -> None:
    """Give every layer compressed-tensors' scheme and qparam parameters, holding its state's
    values (one config group per distinct scheme; targets ``Linear`` when one covers all)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.initialize import (
        initialize_module_for_quantization,
    )

    for args, layers in groups:
        targets = ["Linear"] if len(groups) == 1 and all(
            isinstance(work.get_submodule(n), nn.Linear) for n in layers) else sorted(layers)
        scheme = QuantizationScheme(targets=targets, **{_ARG_NAME[r]: a for r, a in args.items()})
        for layer in layers:
            module = work.get_submodule(layer)
            initialize_module_for_quantization(module, scheme, force_zero_point=False)
            for role, st in states[layer].items():
                _fill(module, role, st, lossy, layer)


def _attach_kv_scales(work: nn.Module, kv, lossy: _Lossy) -> None:
    """The KV cache's scales where vLLM reads them: ``<attention>.k_scale`` / ``v_scale``, in
    the attention's parameter dtype: compressed-tensors loads them into parameters of that
    dtype (``initialize_attn_qparams``), as it does a Linear's scales (vLLM into float32)."""
    for layer, roles in kv.items():
        module = work.get_submodule(layer)
        dtype = _ct_scale_dtype(next(module.parameters()).dtype)
        for role, st in roles.items():
            name = _KV_SCALE[role]
            scale = _cast(st.qparams.scale.detach().reshape(1).float(), dtype, lossy, layer,
                          role, name)
            module.register_parameter(name, nn.Parameter(scale, requires_grad=False))


def _ct_scale_dtype(observed: torch.dtype) -> torch.dtype:
    """compressed-tensors' scale dtype for an observed dtype (``initialize_qparams``; pinned to
    theirs by tests/export/test_ct_scale_dtype_peers.py)."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return observed if observed in floats else torch.float16
