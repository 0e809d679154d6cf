"""The parts of llm-compressor 0.14's observer contract that are not statistics.

:func:`flatten_for_calibration` (the ``(observations, *qparam_shape, elements)`` view each
strategy calibrates on) and :class:`FusionHandler` (observers of fused layers, e.g. q / k / v,
share one NVFP4 global scale), as llm-compressor 0.14 defines them, and
:func:`mx_scale_in_dtype` (compressed-tensors' MX block scale in a model's dtype), with no
dependency on llm-compressor: :mod:`quantscope.compat.llmcompressor` and the llm-compressor
integration build on them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from weakref import ref

import torch
import torch.nn.functional as F

from ..formats import as_int
from ..qparams import amax_of_range
from ..scales import e8m0_scale
from . import enum_name, field

__all__ = ["FUSED_LAYER_NAMES", "FusionHandler", "GroupSizeError", "flatten_for_calibration",
           "fuse_weight_observers", "mx_scale_in_dtype"]


class GroupSizeError(ValueError, RuntimeError):
    """A ``group_size`` that does not divide the observed value's columns: a
    ``RuntimeError`` as llm-compressor's (torch's ``unflatten``), and a ``ValueError`` as
    quantscope's bad-argument errors."""


def flatten_for_calibration(value: torch.Tensor, base_name: str, args) -> torch.Tensor:
    """``value`` as ``(observations, *qparam_shape, elements)`` for ``args.strategy``.

    ``base_name`` says what was observed: ``"weight"`` (``[rows, cols]``), ``"input"`` /
    ``"output"`` (``[batch, seq, hidden]``) or ``"q"`` / ``"k"`` / ``"v"`` (``[batch, heads,
    seq, head_dim]``). Block weights are zero-padded to whole blocks (zeros do not move a
    range that always holds zero).
    """
    strategy = enum_name(field(args, "strategy")) or "tensor"
    kinds = {"weight": _weight_view, "input": _activation_view, "output": _activation_view,
             "q": _attention_view, "k": _attention_view, "v": _attention_view}
    if base_name not in kinds:
        raise ValueError(f"Unknown quantization base name: {base_name}")
    view = kinds[base_name](value, strategy, args)
    if view is None:
        what = {"weight": "weights", "input": "activations", "output": "activations"}
        raise ValueError(f"{_WORDS.get(strategy, strategy.capitalize())} quantization cannot "
                         f"be applied to {what.get(base_name, 'attention')}"
                         if strategy in _STRATEGIES else f"Unknown strategy {strategy}")
    return view


_STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block", "token", "attn_head")
#: llm-compressor's words for a strategy in its messages (a tensor group is a group there)
_WORDS = {"attn_head": "Attention head", "tensor_group": "Group"}


def _weight_view(value, strategy, args):
    if strategy == "tensor":
        return value.reshape(1, 1, -1)
    if strategy == "channel":
        return value.unsqueeze(-2).unsqueeze(0)
    if strategy in ("group", "tensor_group"):
        return _groups(value, args).unsqueeze(0)
    if strategy == "block":
        height, width = field(args, "block_structure")
        rows, cols = value.shape
        value = F.pad(value, (0, -cols % width, 0, -rows % height))
        blocks = value.reshape(value.shape[0] // height, height, value.shape[1] // width, width)
        return blocks.transpose(1, 2).flatten(-2, -1).unsqueeze(0)
    return None


def _activation_view(value, strategy, args):
    if strategy == "tensor":
        return value.reshape(-1, 1, value.size(-1))
    if strategy == "token":
        return value
    if strategy in ("group", "tensor_group"):
        # theirs flattens first: a 2-D [tokens, cols] value is grouped as one row, so only
        # its total need divide (a 3-D value's columns)
        return _groups(value.flatten(0, 1), args)
    return None


def _groups(value, args):
    """``value [..., cols]`` as ``[..., cols / group_size, group_size]``; a group size that
    does not divide ``cols`` is a :class:`GroupSizeError` (torch's ``unflatten`` names
    neither)."""
    size, cols = as_int(field(args, "group_size")), value.shape[-1]
    if size is None or size < 1 or cols % size:
        raise GroupSizeError(f"llm-compressor observer: group_size must be a positive divisor "
                             f"of the observed value's {cols} columns (shape "
                             f"{tuple(value.shape)}), got "
                             f"group_size={field(args, 'group_size')!r}")
    return value.unflatten(-1, (-1, size))


def _attention_view(value, strategy, args):
    by_token = value.transpose(1, 2).flatten(0, 1)  # [batch * seq, heads, head_dim]
    if strategy == "tensor":
        return by_token.flatten(-2, -1).unsqueeze(-2)
    if strategy == "attn_head":
        return by_token.unsqueeze(-2).unsqueeze(-2)
    return None


_GONE = "Fused module has been garbage collected before its weight was observed"


class FusionHandler:
    """One observer's membership of a fusion group (llm-compressor 0.14's contract).

    ``fuse`` links the observers of fused layers and keeps a weak reference to each
    layer, so a member that has not seen its weight yet observes it when the group's
    statistics are asked for; statistics are deleted only when every member is done.
    """

    def __init__(self, observer):
        self._observer = observer
        self._module_ref = None
        self._group: list[FusionHandler] = []
        self._deletion_called = False

    @property
    def is_fused(self) -> bool:
        return bool(self._group)

    @property
    def module(self) -> torch.nn.Module | None:
        return None if self._module_ref is None else self._module_ref()

    @classmethod
    def fuse(cls, observers_and_modules: Iterable[tuple[object, torch.nn.Module]]) -> None:
        """Link every ``(observer, module)`` pair's handler with the others'."""
        handlers = []
        for observer, module in observers_and_modules:
            observer.fusion_handler._module_ref = ref(module)
            handlers.append(observer.fusion_handler)
        for handler in handlers:
            handler._group = [other for other in handlers if other is not handler]

    def get_fused_statistics(self) -> list[dict[str, torch.Tensor]]:
        """The statistics of this observer and every fused one (observing a member's
        weight first where it has none)."""
        members = [self, *self._group]
        for member in members:
            if not member._observer.has_statistics:
                module = member.module
                assert module is not None, _GONE
                member._observer(module.weight)
        return [member._observer.get_statistics() for member in members]

    def maybe_delete_statistics(self) -> None:
        """Delete now when unfused; in a group, once every member has asked."""
        if not self.is_fused:
            self._observer.delete_statistics(check_fused=False)
            return
        self._deletion_called = True
        if all(member._deletion_called for member in self._group):
            for member in (*self._group, self):
                member._deletion_called = False
                member._observer.delete_statistics(check_fused=False)


#: sibling layers whose NVFP4 weights vLLM serves as one layer with one global scale
#: (llm-compressor 0.14's list): gate / up, q / k / v, DeepSeek's q_a / kv_a, MoE w1 / w3
FUSED_LAYER_NAMES = [
    ("gate_proj", "up_proj"),
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
]


def fuse_weight_observers(model: torch.nn.Module) -> None:
    """Fuse the ``tensor_group`` weight observers of every :data:`FUSED_LAYER_NAMES` group in
    ``model`` (a missing layer, e.g. a ``v_proj`` that is None, is skipped); a group whose
    layers lack an observer or mix strategies is an error (vLLM would need one scale)."""
    for parent in model.modules():
        for names in FUSED_LAYER_NAMES:
            if all(hasattr(parent, name) for name in names):
                _fuse_group(names, [getattr(parent, name) for name in names])


def _fuse_group(names, layers) -> None:
    layers = [layer for layer in layers if layer is not None]
    observers = [getattr(layer, "weight_observer", None) for layer in layers]
    pairs = [(obs, layer) for obs, layer in zip(observers, layers)
             if obs is not None and enum_name(field(obs.args, "strategy")) == "tensor_group"]
    if not pairs:
        return
    start, end = f"Some layers in fused group: {names} have", \
        ", need all fused layers to have same quantization"
    assert all(obs is not None for obs in observers), f"{start} no weight observer{end}"
    assert len(pairs) == len(observers), f"{start} non-TENSOR_GROUP quantization{end}"
    type(pairs[0][0].fusion_handler).fuse(pairs)  # the observers' own handler class


def mx_scale_in_dtype(scale: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, fmt,
                      dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors 0.19's MX (E8M0) block scales in ``dtype``, the observed one, of the
    ranges ``[lo, hi]`` whose power of two ``scale`` was computed in float32 (element format
    ``fmt``); never 0.

    compressed-tensors computes the scale from the amax held in ``dtype``. Where that is a
    normal number the power of two is the float32 one, which ``dtype`` holds (float16's
    smallest normal amax, 2**-14, gives 2**-22 at the least). Below it, its
    ``round_to_power_2`` keeps the dtype's exponent bits: a subnormal amax rounds to 0, or from
    0.75 of the smallest normal up to that normal (the carry of its added quarter); a zero
    power of two is the smallest E8M0 scale, 2**-127, which float16 flushes to 0; and a zero
    scale becomes its uint8 ``scale_dtype``'s eps, 1.0. On float16 a block below 2**-14 thus
    gets scale 1 (below 1.5 * 2**-15) or fp4's 2**-16 / fp8's 2**-22; bfloat16 and float32
    blocks get 2**-127 there, float32's scale (then nothing but the cast is computed).
    """
    low = _mx_low_scales(fmt, dtype)
    out = scale.to(dtype)
    if low is None:
        return out
    tiny = torch.finfo(dtype).tiny
    amax = amax_of_range(lo, hi).reshape(-1)  # (lo <= hi: their clamps to 0 change nothing)
    # host reads (qparams, not forward): most tensors have no such block, and masks over
    # every block cost up to a hundred times the cast on the CPU, so only the few are fixed
    if amax.is_meta or amax.numel() == 0 or bool(amax.min() >= tiny):
        return out
    few = torch.nonzero(amax < tiny).reshape(-1)  # held below tiny implies amax below it
    held = amax[few].to(dtype).float()  # the amax as theirs holds it
    zero, carry = low
    fixed = torch.where(held < tiny, torch.where(held < 0.75 * tiny, zero, carry),
                        scale.reshape(-1)[few].float())
    out = scale.to(dtype, memory_format=torch.contiguous_format, copy=True)
    out.view(-1)[few] = fixed.to(dtype)
    return out


@functools.cache
def _mx_low_scales(fmt, dtype: torch.dtype) -> tuple[float, float] | None:
    """The scales in ``dtype`` of a subnormal amax that rounds to 0 and of one that carries to
    the smallest normal (:func:`mx_scale_in_dtype`), or None where both are float32's own
    (the E8M0 floor 2**-127, which ``dtype`` holds)."""
    floor, tiny = 2.0 ** -127, torch.finfo(dtype).tiny
    values = [float(torch.tensor(v).to(dtype)) for v in
              (floor, float(e8m0_scale(torch.tensor(tiny), fmt)))]
    if values == [floor, floor]:
        return None
    return tuple(v if v != 0 else 1.0 for v in values)
