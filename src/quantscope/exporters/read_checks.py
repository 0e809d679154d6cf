"""What every reader of a compressed-tensors folder checks before trusting it.

``Calibration.from_compressed_tensors`` and ``check`` both read a folder someone else may
have written or damaged: its ``config.json``, its safetensors headers, its scale tensors.
This module is the one validation they share; each damage is a ``ValueError`` (or
``FileNotFoundError``) naming the file and the key, never a bare ``KeyError`` or a NaN
carried into ``apply()``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from .._checks import pattern_refusal
from .._jsonfile import parse_json, read_json

__all__ = ["KV_SCHEME", "SCALE_LEAVES", "ZERO_POINTS", "check_kv_scheme", "compressor",
           "exact_pattern", "fmt_name", "kv_scale_layer", "kv_scheme_problem",
           "load_checked_tensors", "missing_zero_point", "neutral_qparams", "parse_quant_config",
           "read_quant_config", "refuse_not_run", "rewriting_modifiers", "safetensors_headers",
           "scale_problem", "scale_values", "storage_problem", "unexpected_qparam",
           "zero_point_problem"]

#: tensors that are scales: finite and > 0 (a zero or negative scale divides by zero or
#: flips signs at run time)
SCALE_LEAVES = ("weight_scale", "input_scale", "output_scale", "weight_global_scale",
                "input_global_scale", "k_scale", "v_scale")

_HEADER_MAX = 100 * 1024 * 1024  # safetensors' own limit on a header


def read_quant_config(path, who: str) -> tuple[Path, dict, dict]:
    """``(config file, config, quantization_config)`` of the folder, checked."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{who}: {cfg_file} does not exist")
    config = read_json(cfg_file, who)
    if not isinstance(config, dict):
        raise ValueError(  # noqa: TRY004 (a bad file is a ValueError naming it)
            f"{who}: {cfg_file} holds a {type(config).__name__}, not an object")
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "compressed-tensors":
        raise ValueError(f"{who}: {cfg_file} has no compressed-tensors quantization_config "
                         f"(quant_method {method!r})")
    _check_patterns(cfg_file, qc, who)
    return cfg_file, config, qc


def _check_patterns(cfg_file, qc: dict, who: str) -> None:
    """Refuse a ``re:`` target or ignore entry that could backtrack for hours (nested
    quantifiers, :func:`~quantscope._checks.regex_problem`), before anything matches it
    (compressed-tensors' matcher, ``check``'s strategies): a regex has no time limit."""
    groups = qc.get("config_groups")
    fields = [(f"config_groups.{g}.targets", s.get("targets"))
              for g, s in (groups.items() if isinstance(groups, dict) else ())
              if isinstance(s, dict)] + [("ignore", qc.get("ignore"))]
    for field, value in fields:
        for i, t in enumerate([value] if isinstance(value, str) else
                              value if isinstance(value, list) else ()):
            why = pattern_refusal(t)
            if why:
                raise ValueError(f"{who}: {cfg_file}: quantization_config.{field}[{i}]: {why}")


def fmt_name(fmt) -> str:
    """A compressed-tensors format's name (``fmt``: the name or its enum)."""
    return str(getattr(fmt, "value", fmt))


def compressor(fmt, where: str):
    """compressed-tensors' compressor of the format ``fmt`` (a name or its enum)."""
    from compressed_tensors.compressors import BaseCompressor

    name = fmt_name(fmt)
    # only a registered name reaches the registry: it would execute a "file.py:value" name
    # (a checkpoint's config.json would run code)
    known = {*BaseCompressor.registered_names(), *BaseCompressor.registered_aliases()}
    if not isinstance(name, str) or name.replace("_", "-").lower() not in known:
        raise ValueError(f"{where}: format {name!r} is no compressed-tensors format "
                         f"(expected one of {sorted(known)})")
    return BaseCompressor.get_value_from_registry(name)


def parse_quant_config(cfg_file, qc: dict, who: str):
    """compressed-tensors' ``QuantizationConfig`` of ``qc``, every field valid (pydantic's
    error names the field) and every format, the config's and each group's, a known one."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        qconfig = QuantizationConfig.model_validate(
            {k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
    except (ValueError, KeyError, TypeError) as e:  # pydantic's ValidationError is a
        # ValueError; compressed-tensors raises KeyError on a group that is no scheme
        # (read as a preset's name)
        raise ValueError(f"{who}: {cfg_file}: quantization_config is not valid: {e}") from None
    where = f"{who}: {cfg_file}: quantization_config"
    if fmt_name(qconfig.format) not in ("None", "mixed-precision"):
        compressor(qconfig.format, where)
    for name, scheme in qconfig.config_groups.items():
        if scheme.format is not None:
            compressor(scheme.format, f"{where}.config_groups.{name}")
    return qconfig


#: quantization_config's sections that change what the stored tensors mean, which quantscope
#: does not run: read without them, the scales would be applied to other tensors
_NOT_RUN = {
    "transform_config": "transforms (rotations such as QuIP's or SpinQuant's Hadamards, some "
                        "applied online by the runtime): the scales are of the rotated "
                        "weights and activations",
    "moe_sparsity_config": "pruned or merged MoE experts (stored left-shifted): the experts "
                           "of config.json's model are not the checkpoint's",
    "sparsity_config": "sparse-compressed weights",
}


def refuse_not_run(cfg_file, qc: dict, who: str) -> None:
    """Refuse a folder whose ``quantization_config`` holds a section in :data:`_NOT_RUN`
    (compressed-tensors' own model validation ignores unknown keys; a ``sparsity_config``
    of the ``dense`` format stores the weights as they are, and is read)."""
    for key, what in _NOT_RUN.items():
        value = qc.get(key)
        if key == "sparsity_config" and isinstance(value, dict) \
                and value.get("format") in (None, "dense"):
            continue
        if value:
            raise ValueError(f"{who}: {cfg_file}: quantization_config.{key} is set: the "
                             f"checkpoint holds {what}, which quantscope does not run")


#: why a KV cache other than fp8 is refused, read or written
_FP8_CACHE = ("vLLM's KV cache is fp8 whatever the scheme says (its kv_cache_dtype; its "
              "compressed-tensors KV-cache method refuses a scheme only where type and "
              "num_bits both differ from float and 8) and would run these scales as fp8 "
              "ones: quantscope writes and reads fp8 KV caches only (type: float, num_bits: 8)")

#: the one ``kv_cache_scheme`` quantscope writes and reads, field by field (the value each
#: needs, and why): static, per-tensor, symmetric fp8, vLLM's fp8 cache and its k_scale /
#: v_scale. The export's rule for what it writes and the reader's for what it reads
#: (:func:`kv_scheme_problem`)
KV_SCHEME = {
    "dynamic": (False, ("quantscope's KV cache supports static scales only (k_scale / v_scale "
                        "calibrated once, dynamic: false)")),
    "strategy": ("tensor", "quantscope's KV cache has one scale per tensor (strategy: tensor)"),
    "symmetric": (True, ("quantscope's KV cache is fp8, symmetric only (symmetric: true; vLLM "
                         "refuses an asymmetric compressed-tensors KV cache too)")),
    "type": ("float", _FP8_CACHE),
    "num_bits": (8, _FP8_CACHE),
}


def kv_scheme_problem(args) -> str | None:
    """``"<field> is <value>: <why>"`` for the first field of the ``kv_cache_scheme`` args
    (compressed-tensors' ``QuantizationArgs``) that is not :data:`KV_SCHEME`'s, else None."""
    for field, (want, why) in KV_SCHEME.items():
        got = getattr(args, field)
        got = getattr(got, "value", got)  # (an enum: its name in the config)
        if got != want:  # (as the config's JSON writes it: true, "tensor")
            return f"{field} is {json.dumps(got, default=str)}: {why}"
    return None


def check_kv_scheme(args, where: str) -> None:
    """Refuse a ``kv_cache_scheme`` quantscope does not run (:func:`kv_scheme_problem`),
    naming the field (``where``: who reads it and the config file). Read as static, a dynamic
    scheme's stored scales would pass for calibrated ones, or, with none, ``apply()`` would
    leave the cache in float without a word; an int or 4-bit one would run a KV cache vLLM
    never runs."""
    why = None if args is None else kv_scheme_problem(args)
    if why:
        raise ValueError(f"{where}: quantization_config.kv_cache_scheme.{why}")


def kv_scale_layer(key: str, modules: dict, attention: dict, who: str) -> str:
    """The layer of the KV-cache scale tensor ``key`` (``<layer>.k_scale`` / ``v_scale``):
    one of ``modules`` (the model's), and one of ``attention`` (its cached attention modules,
    :func:`~quantscope.calibration.structure.kv_cache.attention_modules`), else refused:
    ``apply()`` could not run it, and the pair check would name the wrong problem."""
    layer = key.rpartition(".")[0]
    if layer not in modules:
        raise ValueError(f"{who}: tensor {key!r} belongs to no layer of the model built from "
                         f"config.json")
    if layer not in attention:
        raise ValueError(f"{who}: tensor {key!r} is on {layer} "
                         f"({type(modules[layer]).__name__}), which is no cached attention "
                         f"module: k_scale / v_scale belong to attention modules "
                         f"(e.g. {sorted(attention)[:2] or 'none in this model'})")
    return layer


def load_checked_tensors(path, who: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, read by ``who``; a lying header or a
    scale that is NaN, inf or <= 0 is refused here, naming its file (``apply()`` would
    otherwise turn it into NaN logits)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{who}: {path} holds no .safetensors file")
    safetensors_headers(path, who)
    tensors = {}
    for f in files:
        file = os.path.join(path, f)
        try:
            loaded = load_file(file)
        except (SafetensorError, RuntimeError, OSError) as e:
            raise ValueError(f"{who}: {file}: not a readable safetensors file ({e})") from None
        for name, t in loaded.items():
            why = scale_problem(name, t) if name.rpartition(".")[2] in SCALE_LEAVES else None
            if why:
                raise ValueError(f"{who}: {file}: {why}")
        tensors.update(loaded)
    return tensors


def safetensors_headers(folder, who: str) -> dict[str, tuple[Path, str, list[int]]]:
    """name -> (file, dtype, shape) of every tensor in the folder's safetensors files,
    from their headers (a header that lies about its length or shape is refused)."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        if not f.is_file():  # a FIFO would block the open, a folder fail it bare
            raise ValueError(f"{who}: {f}: not a regular file (a safetensors file holds bytes)")
        with open(f, "rb") as fh:
            raw = fh.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= min(_HEADER_MAX, os.path.getsize(f) - 8):
                raise ValueError(f"{who}: {f}: header length {n} does not fit the file")
            try:
                text = fh.read(n).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{who}: {f}: header is not UTF-8 JSON ({e})") from None
            header = parse_json(text, f"{who}: {f}: header")
        if not isinstance(header, dict):
            raise ValueError(f"{who}: {f}: header is not a JSON object")  # noqa: TRY004
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            ok = isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and \
                isinstance(meta.get("shape"), list) and \
                all(type(d) is int and d >= 0 for d in meta["shape"])  # JSON true is no size
            if not ok:
                raise ValueError(f"{who}: {f}: tensor {name!r} has no valid dtype and shape")
            if name in out:  # which copy a runtime loads depends on its index: neither is safe
                raise ValueError(f"{who}: tensor {name!r} is in both {out[name][0]} and {f}")
            out[name] = (f, meta["dtype"], meta["shape"])
    return out


def scale_values(tensor: torch.Tensor) -> torch.Tensor:
    """The scales a stored scale tensor stands for, as float32: a uint8 one holds MX's E8M0
    codes (compressed-tensors' MXFP4 scales), read by torch's E8M0 dtype (code 255 is NaN,
    OCP MX v1.0 5.4.1), not as the integers 0..255."""
    if tensor.dtype == torch.uint8:
        return tensor.view(torch.float8_e8m0fnu).float()
    return tensor.float()


def scale_problem(name: str, tensor: torch.Tensor) -> str | None:
    """Why the scale tensor ``name`` cannot be used (None when it is finite and > 0)."""
    t = scale_values(tensor)
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        return f"{name} holds NaN or inf ({float(t[bad].reshape(-1)[0])!r})"
    bad = t <= 0
    if bool(bad.any()):
        return f"{name} holds a scale <= 0 ({float(t[bad].reshape(-1)[0])!r})"
    return None


def zero_point_problem(name: str, tensor: torch.Tensor, spec) -> str | None:
    """Why the zero point tensor ``name`` cannot be ``spec``'s (None when every value is an
    integer of its format, in ``[qmin, qmax]``)."""
    whole = not tensor.is_floating_point() or bool((tensor == tensor.round()).all())
    if tensor.numel() and not (whole and spec.qmin <= float(tensor.min())
                               <= float(tensor.max()) <= spec.qmax):
        return (f"{name} holds values that are no integers in [{int(spec.qmin)}, "
                f"{int(spec.qmax)}] ({spec})")
    return None


#: the tensors that hold a module's weight (codes, packed codes, the unpacked shape)
_WEIGHT_KEYS = ("weight", "weight_packed", "weight_shape")


def neutral_qparams(stored: dict, spec, weight_shape, device=None) -> dict:
    """Scales of 1 and zero points of 0 in ``spec``'s shapes, for the quantization tensors
    of ``stored``: qparams on which compressed-tensors' compressor tells what it stores."""
    qshape = spec.layout.qparam_shape(weight_shape)
    f32 = {"dtype": torch.float32, "device": device}
    neutral = {"weight_scale": lambda: torch.ones(qshape, **f32),
               "weight_global_scale": lambda: torch.ones(1, **f32),
               "weight_zero_point": lambda: torch.zeros(qshape, dtype=torch.int8,
                                                        device=device)}
    return {k: make() for k, make in neutral.items() if k in stored}


def _written(decompressed: dict, fmt, scheme, spec, weight_shape, meta: bool) -> dict | str:
    """What compressed-tensors' compressor writes for a zero weight of ``weight_shape`` with
    the qparams of ``decompressed`` (name -> tensor; on the meta device with ``meta``), or
    why it writes nothing of the config's ``weights`` args."""
    from compressed_tensors.quantization import QuantizationArgs

    # the format's own rule for the weights args it stores (an NVFP4 packer decodes fp4
    # whatever num_bits says); its rules on activations are set aside: older writers stored
    # weight-only int8 as int-quantized
    neutral = scheme.model_copy(update={"input_activations": QuantizationArgs(num_bits=8)})
    decoder = compressor(fmt, "format")
    if not decoder.can_compress(torch.nn.Linear, neutral):
        return f"format {fmt_name(fmt)!r} does not store the config's weights ({spec})"
    probe = {k: v for k, v in decompressed.items() if k != "weight"}
    if "weight_zero_point" in probe:  # as compressed-tensors holds it (``zp_dtype``): the
        # one it writes is that, or that packed; a float one would pass through unchecked
        probe["weight_zero_point"] = probe["weight_zero_point"].to(scheme.weights.zp_dtype)
    probe["weight"] = torch.zeros(weight_shape, dtype=torch.float32,
                                  device="meta" if meta else None)
    try:
        return decoder.compress(probe, scheme)
    except Exception as e:  # noqa: BLE001 -- compressed-tensors raises many types
        return f"compressed-tensors cannot store its weights as the config says ({e})"


def storage_problem(layer: str, stored: dict, decompressed: dict, fmt, scheme, spec,
                    weight_shape, meta: bool = False) -> str | None:
    """Why the module ``layer``'s stored tensors are not what compressed-tensors writes for
    the config's ``weights`` args (a config edited to other ``num_bits`` / ``type`` than the
    data, a scale of another layer's rows), or None. compressed-tensors' own compressor, run
    on a zero weight of the module's shape with the read scales (:func:`_written`), gives the
    names, dtypes and shapes it writes: every shape is compared before any dtype, the
    weight's tensors first; int codes stored unpacked must lie in the format's range.
    ``meta``: the shapes only, against those compressed-tensors gives on the meta device
    (``decompressed``: :func:`neutral_qparams` there): nothing of the size ``config.json``
    claims for the module is allocated, so a config claiming a 32768 x 32768 layer beside a
    32 x 32 one costs no 4 GiB of zeros. Run first, it bounds what the full check and the
    decoding allocate by the bytes on disk, and names a misshapen scale that the decoder
    would broadcast into an error naming no tensor ("The size of tensor a (128) must match
    the size of tensor b (64)")."""
    written = _written(decompressed, fmt, scheme, spec, weight_shape, meta)
    if isinstance(written, str):
        return f"{layer}: {written}"
    keys = sorted(written, key=lambda k: k not in _WEIGHT_KEYS)  # stable: the weight's first
    for mismatch in (_shape_mismatch,) if meta else (_shape_mismatch, _dtype_mismatch):
        for key in keys:
            got = stored.get(key)
            why = None if got is None else mismatch(layer, key, got, written[key], spec, meta)
            if why:
                return why
    why = None if meta else _code_problem(stored.get("weight"), spec)
    return why and f"{layer}: {why}"


def _dtype_mismatch(layer: str, key: str, got, want, spec, meta: bool = False) -> str | None:
    """Why the stored ``key`` is not of the dtype and shape compressed-tensors writes."""
    if got.dtype == want.dtype and got.shape == want.shape:
        return None
    return (f"{layer}: {key} is {got.dtype} {list(got.shape)}, but the config's weights "
            f"({spec}) are stored as {want.dtype} {list(want.shape)}")


def _shape_mismatch(layer: str, key: str, got, want, spec, meta: bool) -> str | None:
    """Why the stored ``key`` is not of the shape compressed-tensors writes (``weight_shape``:
    not the values it writes, the layer's shape in the model ``config.json`` describes)."""
    if key == "weight_shape" and want.device.type != "meta" and (
            got.shape != want.shape or got.tolist() != want.tolist()):
        held = got.tolist() if got.numel() <= 8 else f"{got.numel()} values"
        return (f"{layer}.weight_shape holds {held}, but the layer's weight is "
                f"{want.tolist()} in the model built from config.json")
    if key in _WEIGHT_KEYS:
        return None if got.shape == want.shape else _dtype_mismatch(layer, key, got, want, spec)
    if meta and key == "weight_zero_point":  # compressed-tensors packs it (pack-quantized)
        return None  # off the meta device only: the full check compares it
    if got.shape == want.shape or got.numel() == 1 == want.numel():  # one value: any shape,
        return None  # as a per-tensor qparam is read (``_qparam``)
    if key in ZERO_POINTS and got.dtype != want.dtype:  # the scheme's dtype (a scale's is the
        # probe's): a zero point stored unpacked where it is packed says so
        return _dtype_mismatch(layer, key, got, want, spec)
    return f"{layer}.{key} has shape {list(got.shape)}, expected {list(want.shape)}"


def _code_problem(codes, spec) -> str | None:
    """Why the stored int or float8 codes ``weight`` cannot run (None: no unpacked codes)."""
    if codes is not None and codes.is_floating_point():  # float8 codes: NaN codes exist
        bad = ~torch.isfinite(codes.float())
        if bool(bad.any()):
            at = [int(i) for i in bad.nonzero()[0]]
            return (f"weight holds {int(bad.sum())} NaN / inf codes (the first at {at}): "
                    f"the layer's weights ({spec}) would run as NaN")
    elif codes is not None and codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < spec.qmin or hi > spec.qmax:
            return (f"weight holds codes in [{lo}, {hi}], outside the config's weights "
                    f"({spec}) range [{int(spec.qmin)}, {int(spec.qmax)}]")
    return None


#: llm-compressor modifiers that quantize the weights as they are (their qparams are the
#: whole story); any other ``...Modifier`` of a recipe changes the weights first (GPTQ, AWQ,
#: SmoothQuant, SpinQuant, pruning)
_QPARAMS_ONLY = ("QuantizationModifier",)


def rewriting_modifiers(path) -> list[str]:
    """The modifiers in the folder's ``recipe.yaml`` (llm-compressor writes it beside the
    checkpoint) that change the weights before quantizing them: the checkpoint's codes are
    then no rounding of the float model's weights. Read as text (a ``Name:`` key ending in
    ``Modifier``), never run; [] without a readable recipe."""
    import re

    try:
        text = (Path(path) / "recipe.yaml").read_text(errors="replace")
    except OSError:
        return []
    names = re.findall(r"^\s*(\w+Modifier)\s*:", text, flags=re.MULTILINE)
    return sorted({n for n in names if n not in _QPARAMS_ONLY})


def exact_pattern(name: str, classes=()) -> str:
    """A compressed-tensors target or ignore entry as a quantscope pattern that matches what
    it matches: a ``re:`` one as it is; a module's exact name as itself, but as the regex of
    itself where quantscope would read more (a glob: ``[``, ``*``, ``?``; a name among
    ``classes``, which quantscope also matches by class)."""
    if name.startswith("re:") or not (set(name) & set("[*?") or name in classes):
        return name
    return "re:" + re.escape(name) + "$"


_QPARAM_ENDS = ("_scale", "_zero_point")
ZERO_POINTS = ("weight_zero_point", "input_zero_point", "output_zero_point")


def _qparam_leaves(roles: dict, specs: dict) -> set[str]:
    """The quantization tensors compressed-tensors writes for a layer of ``roles`` (name ->
    args): a static role's scale, its zero point only where asymmetric (its compressors drop
    a symmetric one), a global scale only where the format has one (NVFP4), none for a
    dynamic role (NVFP4's ``local`` one: its global scale)."""
    out = set()
    for role, args in roles.items():
        if args.dynamic is True:
            continue
        if specs[role].scale.has_global_scale:
            out.add(f"{role}_global_scale")
        if args.dynamic is False:
            out.add(f"{role}_scale")
            if not args.symmetric:
                out.add(f"{role}_zero_point")
    return out


def unexpected_qparam(stored: dict, roles: dict, specs: dict, keep) -> str | None:
    """Why a quantization tensor of a read layer is none its scheme has (a zero point on a
    symmetric role, a global scale off NVFP4, a scale of no role), or None: compressed-tensors
    never writes one and its runtime ignores it, so reading it would run otherwise. ``keep``:
    the leaves read elsewhere (the layer's own parameters, KV-cache scales)."""
    want = _qparam_leaves(roles, specs)
    for leaf in stored:
        if not leaf.endswith(_QPARAM_ENDS) or leaf in want or leaf in keep:
            continue
        role = leaf.partition("_")[0]
        if role in roles and leaf.endswith("_zero_point") and roles[role].symmetric:
            why = f"the config's {role} ({specs[role]}) is symmetric: it has no zero point"
        elif role in roles and leaf.endswith("_global_scale"):
            why = f"the config's {role} ({specs[role]}) has no global scale"
        else:
            why = f"the config's scheme has no such tensor (its roles: {', '.join(roles)})"
        return (f"{leaf} is stored, but {why}; compressed-tensors writes only "
                f"{sorted(want)} for this layer's quantization")
    return None


_ROLE_NAMES = {"weight": "weights", "input": "input activations",
               "output": "output activations"}


def missing_zero_point(layer: str, stored: dict, roles: dict, specs: dict) -> str | None:
    """Why a zero point compressed-tensors writes for the layer ``layer`` (a static
    asymmetric role's) is not stored, or None: its decoder asserts on the weight's ("Asymmetric
    quant requires zero-point values"), and an activation's would read as 0."""
    want = _qparam_leaves(roles, specs)
    for role in roles:
        if f"{role}_zero_point" in want and f"{role}_zero_point" not in stored:
            return (f"asymmetric {_ROLE_NAMES[role]} need {layer}.{role}_zero_point "
                    f"({specs[role]}), which is not stored")
    return None
