"""The one translation of llm-compressor's ``QuantizationArgs`` into a :class:`QuantSpec`.

Both observer API generations (:mod:`.llmcompressor`, llm-compressor 0.14's, and
:mod:`.llmcompressor_legacy`, the seed's), the llm-compressor integration, the exporters'
readers and recipes call :func:`llmcompressor_spec`.

``args`` is a compressed-tensors ``QuantizationArgs`` or a dict with its fields
(num_bits, type, symmetric, strategy, group_size, block_structure, dynamic,
actorder, scale_dtype, zp_dtype, observer_kwargs).
"""

from __future__ import annotations

import torch

from .._plainchecks import block_structure
from ..layout import Block, Channel, Group, Tensor, Tile, Token
from ..spec import QuantSpec
from . import enum_name, field

__all__ = ["llmcompressor_spec", "scale_dtype", "scales_times_global_scale", "search_spec",
           "unit_search_spec", "zp_dtype"]

_FLOATS = {8: "fp8_e4m3", 6: "fp6_e2m3", 4: "fp4_e2m1"}
_SCALE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def scale_dtype(args) -> torch.dtype | None:
    """The args' ``scale_dtype`` as a torch dtype (a name such as ``"torch.float16"`` or
    ``"uint8"`` too), None when not set: the one place it is parsed as a dtype (the export's
    serving checks, which import no torch, compare its name)."""
    value = field(args, "scale_dtype")
    if not isinstance(value, str):
        return value
    dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):  # a name no dtype has: a bad value
        raise ValueError(  # noqa: TRY004
            f"llmcompressor: scale_dtype must name a torch dtype, got {value!r}")
    return dtype


def llmcompressor_spec(args, base_name: str = "weight", g_idx: torch.Tensor | None = None
                       ) -> QuantSpec:
    """The :class:`QuantSpec` of a ``QuantizationArgs`` (or dict) for ``base_name`` (the one
    translation)."""
    return _translate(args, base_name, filled_g_idx(g_idx), scale_dtype(args))


def filled_g_idx(g_idx: torch.Tensor | None) -> torch.Tensor | None:
    """``g_idx``, or None (column order) where it holds -1: compressed-tensors' placeholder
    until GPTQ fills it, read as column order by llm-compressor (``-1 in g_idx``)."""
    return None if g_idx is None or bool((g_idx == -1).any()) else g_idx


def search_spec(args, base_name: str = "weight") -> QuantSpec:
    """The spec llm-compressor 0.14's MSE and imatrix searches price candidates with: a
    ``tensor_group`` one as without its ``scale_dtype`` (they drop it to search, mse_quant.py
    and imatrix.py: float32 candidate scales)."""
    tensor_group = enum_name(field(args, "strategy")) == "tensor_group"
    return _translate(args, base_name, None, None if tensor_group else scale_dtype(args))


def unit_search_spec(spec: QuantSpec) -> QuantSpec:
    """``spec`` (a :func:`search_spec`) for pricing a search's units ``[U, E]``, one qparam
    per unit. Block scales (MX's E8M0, NVFP4's fp8) are priced as encoded, on a ``Block`` of
    the unit (llm-compressor's candidates get their ``scale_dtype``): a weight's unit is one
    block; an activation's spans many tokens' blocks, one candidate range and so one encoded
    scale for all (theirs bit for bit; float32 scales chose other MX activation ranges)."""
    return spec.replace(layout=Block(spec.layout.size) if spec.scale.is_block else Channel(0))


#: the smallest positive float32: as the spec's min scale it changes only zero scales, which
#: then stand out (compressed-tensors replaces exact zeros by eps, keeps tiny scales)
_ZERO_STAND_IN = 2.0 ** -149


def tiny_scales_kept(spec: QuantSpec) -> QuantSpec:
    """A search's spec with compressed-tensors' eps rule: only a zero candidate scale becomes
    eps (quantscope's floor of float32's eps changed the candidates of ranges below ~1e-5).
    NVFP4's are priced as theirs, float32 without the global scale; MX's E8M0 as encoded."""
    if spec.scale.has_global_scale:
        return spec.replace(scale="fp32", eps=_ZERO_STAND_IN)
    return spec if spec.scale.is_block else spec.replace(eps=_ZERO_STAND_IN)


def default_strategy(group_size) -> str:
    """compressed-tensors' strategy of args that name none: ``group`` where a group size is
    given, ``channel`` for its -1 (one group a row), else ``tensor``."""
    return {None: "tensor", -1: "channel"}.get(group_size, "group")


def _translate(args, base_name: str, g_idx: torch.Tensor | None, sdtype: torch.dtype | None
               ) -> QuantSpec:
    """:func:`llmcompressor_spec` with the scale dtype given."""
    bits = int(field(args, "num_bits", 8))
    kind = enum_name(field(args, "type")) or "int"
    symmetric = field(args, "symmetric", True)
    symmetric = True if symmetric is None else bool(symmetric)
    group_size = field(args, "group_size")
    strategy = enum_name(field(args, "strategy"))
    if strategy is None:
        strategy = default_strategy(group_size)
    if kind == "float":
        if bits not in _FLOATS:
            raise ValueError(f"llmcompressor: float num_bits must be one of {list(_FLOATS)}, "
                             f"got {bits}")
        fmt = _FLOATS[bits]
    elif kind == "int":
        fmt = f"int{bits}"
    else:
        raise ValueError(f"llmcompressor: type must be 'int' or 'float', got {kind!r}")
    scale = "fp32"
    if strategy == "tensor":
        layout = Tensor()
    elif strategy == "channel":
        layout = Channel(0 if base_name == "weight" else -1)
    elif strategy in ("group", "tensor_group"):
        if not group_size or group_size < 1:
            raise ValueError(f"llmcompressor: strategy {strategy} needs a positive group_size, "
                             f"got {group_size!r}")
        mx = kind == "float" and group_size == 32 and sdtype == torch.uint8 \
            and strategy == "group"
        if strategy == "tensor_group" and not _fp8_block_scales(kind, sdtype):
            layout = Group(group_size, -1)  # the caller applies the global scale
        elif strategy == "tensor_group":
            layout, scale = Block(group_size), "fp8_e4m3"
        elif mx:
            layout, scale = Block(group_size), "e8m0:even"
        else:
            layout = Group(group_size, -1, g_idx)
    elif strategy == "block":
        layout = Tile(*block_structure("llmcompressor", field(args, "block_structure")))
    elif strategy == "token":
        layout = Token()
    elif strategy == "attn_head":
        layout = Channel(1)
    else:
        raise ValueError(f"llmcompressor: unknown strategy {strategy!r}; expected tensor, "
                         f"channel, group, tensor_group, block, token or attn_head")
    if scale == "fp32" and sdtype is not None:
        _check_scale_dtype(sdtype, strategy)
        scale = _SCALE_DTYPES.get(sdtype, "fp32")
    zp = field(args, "zp_dtype")
    if kind == "int" and not symmetric and isinstance(zp, torch.dtype) and zp.is_floating_point:
        # compressed-tensors keeps such zero points unrounded (NaN for an all-zero range)
        raise ValueError(f"llmcompressor: zp_dtype {zp} (fractional zero points) has no "
                         f"quantscope encoding: an integer format's zero point is a code; use "
                         f"an integer zp_dtype (int8 by default)")
    return QuantSpec(fmt, layout, symmetric=symmetric, scale=scale)


def _check_scale_dtype(sdtype: torch.dtype, strategy: str) -> None:
    """Refuse a ``scale_dtype`` quantscope has no scale encoding for: fp8 outside
    ``tensor_group``, other floats than float32 / float16 / bfloat16 / float8_e4m3fn (their
    scales would be float32 silently), and integers outside MX (compressed-tensors rounds
    those scales to integers, clamped to the dtype's range)."""
    if sdtype == torch.float8_e4m3fn and strategy != "tensor_group":
        raise ValueError("llmcompressor: fp8 scales need strategy tensor_group (NVFP4)")
    if sdtype.is_floating_point and sdtype not in (*_SCALE_DTYPES, torch.float8_e4m3fn):
        raise ValueError(f"llmcompressor: scale_dtype {sdtype} has no quantscope scale "
                         f"encoding; use float32, float16, bfloat16 or (tensor_group) "
                         f"float8_e4m3fn")
    if not sdtype.is_floating_point:
        raise ValueError(f"llmcompressor: scale_dtype {sdtype} (integer scales) is supported "
                         f"only for MX (float elements, strategy group, group_size 32, "
                         f"scale_dtype torch.uint8); quantscope has no integer scale encoding")


def _fp8_block_scales(kind: str, sdtype: torch.dtype | None) -> bool:
    """Whether a ``tensor_group`` spec encodes fp8 e4m3 block scales under the global scale
    (NVFP4): float elements whose ``scale_dtype`` is float8_e4m3fn (NVFP4's presets) or unset.
    Another float ``scale_dtype`` (float16, bfloat16) is what compressed-tensors rounds the
    float32 scales times the global scale to: no fp8 step in between."""
    return kind == "float" and sdtype in (None, torch.float8_e4m3fn)


def scales_times_global_scale(args) -> bool:
    """A ``tensor_group`` spec whose scales compressed-tensors computes as float32 scales times
    the global scale, then rounds to a float ``scale_dtype`` if set: integer elements, no
    ``scale_dtype``, a float one other than float8_e4m3fn, or fp8 / fp6 elements (their
    scale is ``amax / element max`` times compressed-tensors' fp4-based global scale, not
    the block scale of :func:`llmcompressor_spec`'s ``Block``, whose global scale is the
    element's own); only NVFP4's (fp4 elements, fp8 scales) are the spec's."""
    if enum_name(field(args, "strategy")) != "tensor_group":
        return False
    sdtype = scale_dtype(args)
    nvfp4 = int(field(args, "num_bits", 8)) == 4 and \
        _fp8_block_scales(enum_name(field(args, "type")) or "int", sdtype)
    return sdtype is None or not nvfp4


def zp_dtype(args, spec: QuantSpec) -> torch.dtype:
    """compressed-tensors' zero-point dtype: ``args.zp_dtype`` if set, else float8_e4m3fn for
    float formats and the narrowest signed integer that holds the codes."""
    dtype = field(args, "zp_dtype")
    if isinstance(dtype, torch.dtype):
        return dtype
    if spec.is_float:
        return torch.float8_e4m3fn
    bits = spec.format.bits
    return torch.int8 if bits <= 8 else torch.int16 if bits <= 16 else torch.int32
