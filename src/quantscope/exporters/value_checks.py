"""The stored values :func:`~quantscope.exporters.check` refuses one tensor at a time: a
scale that is not finite and > 0, and a zero point that is no integer of its layer's format
(from_compressed_tensors refuses both: :func:`.read_checks.scale_problem`,
:func:`.read_checks.zero_point_problem`). Only those tensors are read, each from its file."""

from __future__ import annotations

import torch

from .read_checks import SCALE_LEAVES, fmt_name, scale_problem, scale_values, zero_point_problem
from .serving import resolver

__all__ = ["read_tensor", "scale_problems", "zero_point_problems"]

#: each stored zero point's config field (compressed-tensors' QuantizationScheme's) and role
_ZERO_POINT_ARGS = {"weight_zero_point": ("weights", "weight"),
                    "input_zero_point": ("input_activations", "input"),
                    "output_zero_point": ("output_activations", "output")}


def read_tensor(entries, name, values=scale_values) -> torch.Tensor:
    """``values`` of the stored tensor ``name`` (``entries``: :func:`.read_checks.
    safetensors_headers`); by default the scales it stands for, as float32 (E8M0 codes
    decoded)."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ImportError("check needs safetensors: pip install 'quantscope[model]'") from None

    try:
        with safe_open(str(entries[name][0]), framework="pt") as f:
            return values(f.get_tensor(name))
    except (SafetensorError, RuntimeError, OSError) as e:
        raise ValueError(f"check: {entries[name][0]}: tensor {name!r} cannot be read "
                         f"({e})") from None


def scale_problems(entries) -> list[dict]:
    """Every scale, per-channel ones too, that is not finite and > 0."""
    problems = []
    for name in entries:
        layer, _, leaf = name.rpartition(".")
        if leaf in SCALE_LEAVES:
            values = read_tensor(entries, name)
            why = scale_problem(name, values)
            if why:
                problems.append({"tensor": name, "values": {layer: float(
                    values[~torch.isfinite(values) | (values <= 0)].reshape(-1)[0])},
                    "non_finite": True, "why": why})
    return problems


def zero_point_problems(qconfig, entries) -> list[dict]:
    """Every stored zero point that is no integer of its layer's format (``qconfig``:
    compressed-tensors' parsed ``QuantizationConfig``; the layer's config group resolved as
    vLLM resolves it). A ``pack-quantized`` weight's zero points are packed, eight to an
    int32: compressed-tensors unpacks them when the checkpoint is read, and the reader checks
    them then."""
    from ..compat.llmcompressor_spec import llmcompressor_spec

    groups = qconfig.config_groups
    resolve = resolver([(str(t), n) for n, g in groups.items() for t in g.targets])
    problems = []
    for name in entries:
        layer, _, leaf = name.rpartition(".")
        found = resolve(layer) if leaf in _ZERO_POINT_ARGS else ()
        if len(found) != 1:
            continue
        group = groups[next(iter(found))]
        field, role = _ZERO_POINT_ARGS[leaf]
        args = getattr(group, field)
        if args is None or (role == "weight" and fmt_name(group.format or qconfig.format)
                            == "pack-quantized"):
            continue
        try:
            spec = llmcompressor_spec(args, role)
        except ValueError:  # no quantscope format: the reader names the group's args
            continue
        if why := zero_point_problem(name, read_tensor(entries, name, lambda t: t), spec):
            problems.append({"tensor": name, "values": {}, "zero_point": True, "why": why})
    return problems
