"""AMD Quark's ``QTensorConfig`` as a :class:`~quantscope.spec.QuantSpec`: the one
translation every Quark compat class reads its qspec by, and Quark's ``quant_min`` /
``quant_max`` of a dtype."""

from __future__ import annotations

import torch

from ..layout import Block, Tensor
from ..spec import QuantSpec
from . import enum_name, field
from .quark_scales import FP8_E5M3, _quark_layout

__all__ = ["quark_qmin_qmax", "quark_spec"]

_INT = {"int2", "int3", "int4", "int8", "int16", "uint2", "uint4", "uint8"}
_FLOAT = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "fp6_e3m2": "fp6_e3m2",
          "fp6_e2m3": "fp6_e2m3", "fp4": "fp4_e2m1", "fp8_e5m3": FP8_E5M3}
_CAST = {"float16", "bfloat16"}
_SCALE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def quark_spec(qspec, *, pad_blocks: bool = False, uniform: bool = False,
               qscheme: str | None = None, fp4_scale_formats: bool = False,
               dtype: str | None = None) -> QuantSpec:
    """The :class:`QuantSpec` of a Quark ``QTensorConfig`` (object or dict; the one translation).

    Casts (float16 / bfloat16) give a placeholder int8 per-tensor spec that nothing prices:
    Quark takes them with ``PlaceholderObserver`` only (its other observers refuse them).
    ``pad_blocks``: a float32-scaled per_group qspec takes the padding :class:`Block` layout
    (Quark's block observers pad the last block), not :class:`Group` (its per-group one
    refuses a group size that does not divide the axis). ``uniform``: the spec of Quark's
    uniform-scaling observers, whose ``calculate_int_quant_params`` (and fp8 formula on a
    per-tensor / per-channel range) never reads ``scale_format``: an integer dtype, and fp8
    there, take float32 scales whatever it says. ``qscheme``: the one of a qspec without one
    (the class's granularity; else per_tensor); ``dtype``: the one a class prices whatever
    the qspec's is (Quark's ``PerBlockBFPObserver``: bfp16). ``fp4_scale_formats``: fp4 /
    fp6 per tensor / channel take an e8m0 / e4m3 / e5m3 ``scale_format`` (a float32-scaled
    spec: the observer prices fp4 with Quark's ``get_scale``, fp6 never reads it), as
    Quark's uniform classes.
    """
    dtype = dtype or enum_name(field(qspec, "dtype"))
    qscheme = enum_name(field(qspec, "qscheme")) or qscheme or "per_tensor"
    ch_axis, group_size = field(qspec, "ch_axis"), field(qspec, "group_size")
    symmetric = field(qspec, "symmetric")
    symmetric = True if symmetric is None else bool(symmetric)
    scale_format = enum_name(field(qspec, "scale_format")) or "float32"
    fp8 = isinstance(dtype, str) and dtype.startswith("fp8")  # (None: refused below)
    if uniform and (dtype in _INT or (fp8 and qscheme != "per_group")):
        # Quark's integer formula, and its fp8 one on a per-tensor / per-channel range,
        # never read scale_format: plain amax-based scales
        scale_format = "float32"
    mode = enum_name(field(qspec, "scale_calculation_mode")) or "even"
    round_method = enum_name(field(qspec, "round_method"))
    if round_method not in (None, "half_even", "8"):
        raise ValueError(f"quark: round_method {round_method!r} is not supported; "
                         f"quantscope rounds half to even")
    if dtype in _CAST:
        return QuantSpec("int8", Tensor())
    if dtype == "bfp16":
        return QuantSpec("int8_narrow", Block(group_size or 8, -1 if ch_axis is None else ch_axis),
                         scale="e8m0:even")
    if dtype == "mx":
        element = enum_name(field(qspec, "mx_element_dtype"))
        if element not in _FLOAT and element != "int8":
            raise ValueError(f"quark: mx_element_dtype must be one of {[*_FLOAT, 'int8']}, "
                             f"got {element!r}")
        fmt = "int8_narrow" if element == "int8" else _FLOAT[element]
        return QuantSpec(fmt, Block(group_size or 32, -1 if ch_axis is None else ch_axis),
                         scale=f"e8m0:{mode}")
    if dtype in _FLOAT:
        fmt = _FLOAT[dtype]
    elif dtype in _INT:
        fmt = dtype
    elif dtype == "int32":  # Quark's calculate_qmin_qmax has it
        raise ValueError("quark: dtype 'int32' is not supported: quantscope's integer formats "
                         "stop at 16 bits (float32 qparams cannot hold a 32-bit code range "
                         "exactly: 2 ** 31 - 1 rounds to 2 ** 31)")
    else:
        raise ValueError(f"quark: dtype {dtype!r} is not supported; expected one of "
                         f"{sorted(_INT | set(_FLOAT) | _CAST | {'mx', 'bfp16'})}")
    if (scale_format in ("e8m0", "e4m3", "e5m3") and fp4_scale_formats
            and dtype in ("fp4", "fp6_e2m3", "fp6_e3m2")
            and qscheme in ("per_tensor", "per_channel")):
        scale_format = "float32"  # priced with Quark's get_scale (fp6: its integer formula)
    if scale_format in ("e8m0", "e4m3", "e5m3"):  # block scales: MX, NVFP4, AMD FP4
        if qscheme != "per_group" or not group_size:
            raise ValueError(f"quark: scale_format {scale_format!r} needs qscheme per_group "
                             f"with a group_size, got {qscheme!r}, group_size={group_size!r}")
        # e5m3 has no native scale encoding: fp32 here, rounded by quark_float_scale
        scale = {"e8m0": f"e8m0:{mode}", "e4m3": "fp8_e4m3", "e5m3": "fp32"}[scale_format]
        return QuantSpec(fmt, Block(group_size, -1 if ch_axis is None else ch_axis),
                         scale=scale)
    if scale_format != "float32":
        raise ValueError(f"quark: scale_format must be float32, e8m0, e4m3 or e5m3, got "
                         f"{scale_format!r}")
    layout = _quark_layout(qscheme, ch_axis, group_size, pad_blocks)
    return QuantSpec(fmt, layout, symmetric=symmetric if dtype in _INT else True)


def quark_qmin_qmax(dtype) -> tuple[int | float | None, int | float | None]:
    """Quark's ``calculate_qmin_qmax(dtype)`` (its observers' ``quant_min`` / ``quant_max``):
    ints for the integer and fp8 e4m3 / e5m2 dtypes, floats for the others (unsigned E5M3
    from 0); ``(None, None)`` where Quark defines none (mx, bfp16: its function raises)."""
    name = enum_name(dtype)
    if name in _CAST:
        info = torch.finfo(getattr(torch, name))
        return info.min, info.max
    if name == "fp8_e5m3":
        return 0.0, FP8_E5M3.max
    if name not in _INT and name not in _FLOAT:
        return None, None
    fmt = quark_spec({"dtype": name}).format
    if name in _INT or name in ("fp8_e4m3", "fp8_e5m2"):
        return int(fmt.qmin), int(fmt.qmax)
    return float(fmt.qmin), float(fmt.qmax)
