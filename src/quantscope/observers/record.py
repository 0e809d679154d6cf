"""What a saved observer state means, saved with it as ``_extra_state``: the layout its units
follow (act-order groups: their column ``order`` too) and, for histograms, whether they bin
``|x|`` and whether they are in the EMA mode (``ema``: a range averaged over intervals, the
histogram the batches since the last estimate; a subclass adds its own entries). A state of
another meaning is a ``ValueError`` naming both, not silently wrong qparams; a state saved
before the record (or before its ``ema`` entry) loads as then, its EMA mode read from its
buffers where they tell it. The record is JSON in a uint8 tensor, so a state stays all
tensors (safetensors and ``torch.load(weights_only=True)`` read it) and is parsed, never
unpickled."""

from __future__ import annotations

import json

import torch

from .._jsonfile import PARSER_LIMITS
from ..layout import Layout, parse_layout

__all__ = ["RECORD", "at", "check", "check_units", "decode", "encode", "partial", "saved_shape"]

RECORD = "_extra_state"  # torch's key of get_extra_state's value


def at(who: str, prefix: str) -> str:
    """``who`` and the submodule a load is for (``prefix``: ``"layer2."``), as torch's own
    load errors name the key."""
    return f"{who} at {prefix[:-1]!r}" if prefix else who


def encode(record: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(record, sort_keys=True).encode()),
                            dtype=torch.uint8)


def decode(state, who: str) -> dict | None:
    if not isinstance(state, torch.Tensor) or state.is_meta:
        return None  # no record (saved before it: loads as then), or one on meta
    try:
        record = dict(json.loads(bytes(state.reshape(-1).tolist())))
    except (ValueError, TypeError, *PARSER_LIMITS):  # nested past the parser's depth too
        record = {"layout": None}  # unreadable: refused below, as a damaged entry
    if isinstance(record.get("layout", ""), str) and \
            isinstance(record.get("absolute", False), bool) and \
            isinstance(record.get("ema", False), bool) and \
            isinstance(record.get("order", ""), str):
        try:
            if "layout" in record:
                parse_layout(record["layout"])
        except ValueError as e:
            raise ValueError(f"{who}: the state's {RECORD} holds no layout: {e}") from None
        return record
    raise ValueError(f"{who}: the state's {RECORD} is no record")


def saved_shape(state_dict, prefix) -> tuple[int, ...] | None:
    """The shape a saved observer state last observed (None: nothing observed, or unreadable)."""
    tokens, shape = (state_dict.get(prefix + k) for k in ("observed_tokens", "observed_shape"))
    if tokens is None or shape is None or tokens.is_meta or shape.is_meta or not int(tokens):
        return None
    return tuple(shape.tolist())


def partial(state_dict, prefix, sized, who: str) -> str | None:
    """The error of a state that observed data but lacks one of the ``sized`` statistics
    (``load_state_dict(strict=False)`` would load the rest and leave it empty: the observer
    then fails in torch, naming neither itself nor the buffer); None for a whole state."""
    lost = [prefix + n for n in sized if prefix + n not in state_dict]
    if lost and saved_shape(state_dict, prefix) is not None:
        return (f"{at(who, prefix)}: a partial state: it observed data but lacks "
                f"{', '.join(lost)}; load a whole state_dict")
    return None


#: sized buffers held together: all empty (a mode's, or a state made from a range alone: a
#: Horizon state in a histogram class) or all filled, never some (a histogram's C kernel
#: would read past an empty ``hist_exp``); and those of more than one dimension (a
#: histogram's counts, units x bins); the others hold one entry per unit
TOGETHER = (("hist_counts", "hist_exp", "hist_first", "hist_lo", "hist_hi"),
            ("min_vals", "max_vals"), ("ema_lo", "ema_hi"), ("window_lo", "window_hi"))
NDIM = {"hist_counts": 2}


def check_units(state_dict, prefix, layout: Layout, sized, who: str, one_value=()) -> None:
    """``ValueError`` naming ``who`` unless each saved ``sized`` buffer fits ``layout`` for the
    saved shape: one entry per unit along its first dimension (:data:`NDIM` dimensions), one
    for those of ``one_value`` (NVFP4's global amax), or none, as the others of its
    :data:`TOGETHER` group (else ``qparams()`` fails later with a bare reshape, reads another
    unit's entry without a word, or a C kernel reads past an empty buffer)."""
    who, saved = at(who, prefix), state_dict.get(prefix + "observed_shape")
    if saved is not None and not saved.is_meta and (
            saved.dim() != 1 or saved.is_floating_point() or bool((saved < 0).any())):
        raise ValueError(f"{who}: cannot load a state whose observed_shape {saved.tolist()} is "
                         f"no tensor shape (one size >= 0 per dimension)")
    shape = saved_shape(state_dict, prefix)
    if shape is None:
        return
    try:
        units = layout.num_units(shape)
    except ValueError as e:
        raise ValueError(f"{who}: cannot load a state observed with shape {shape}: {e}") \
            from None
    for name in sized:
        t = state_dict.get(prefix + name)
        if t is None:  # (a meta tensor's shape is known too)
            continue
        one = name in one_value
        want, got = 1 if one else units, len(t) if t.dim() else 1
        if got not in (0, want) or (got == 0 and _filled_beside(state_dict, prefix, name)):
            raise ValueError(
                f"{who}: cannot load a state whose {name} has {got} "
                f"{'values' if one else 'units'}; " + ("it holds one value for the tensor"
                if one else f"shape {shape} under {layout} has {units} (the state was "
                f"saved by an observer of another layout, or edited)"))
        dims = 1 if one else NDIM.get(name, 1)  # (one value: [1], as saved; not a scalar)
        if t.numel() and t.dim() != dims:
            raise ValueError(f"{who}: cannot load a state whose {name} has shape "
                             f"{list(t.shape)}: it holds {dims} dimension(s)"
                             + ("" if one else ", the units first"))


def _filled_beside(state_dict, prefix, name: str) -> bool:
    """Whether a buffer of ``name``'s :data:`TOGETHER` group holds entries."""
    group = next((g for g in TOGETHER if name in g), ())
    return any((t := state_dict.get(prefix + n)) is not None and t.numel() for n in group)


def check(state_dict, prefix, mine: dict, who: str) -> None:
    """``ValueError`` naming both for a state saved under a layout of other units for the
    saved shape (act-order groups: another column order, recorded as ``order``; a state
    without one was saved in column order), or binning ``|x|`` where this one (``mine``)
    bins ``x``, or the reverse; or of the EMA mode where this one accumulates, or the
    reverse."""
    who = at(who, prefix)
    saved = decode(state_dict.get(prefix + RECORD), who)
    if "ema" in mine:  # a state saved before the record tells it too (its buffers)
        _check_ema(state_dict, prefix, saved or {}, mine["ema"], who)
    if saved is None:
        return
    other, shape = saved.get("layout", mine["layout"]), saved_shape(state_dict, prefix)
    if saved.get("order") != mine.get("order") or (
            other != mine["layout"] and shape is not None and
            not parse_layout(other).same_units(parse_layout(mine["layout"]), shape)):
        raise ValueError(f"{who}: cannot load a state saved under layout "
                         f"{_described(other, saved)}; this observer's layout is "
                         f"{_described(mine['layout'], mine)}")
    if "absolute" in mine and saved.get("absolute", mine["absolute"]) != mine["absolute"]:
        what = ("x (asymmetric)", "|x| (symmetric)")
        raise ValueError(f"{who}: cannot load a histogram of {what[saved['absolute']]} into "
                         f"this one's, of {what[mine['absolute']]}")


def _check_ema(state_dict, prefix, saved: dict, mine: bool, who: str) -> None:
    """An EMA state's histogram holds only the batches since the last estimate (none right
    after one: a range of ~0 read as a whole histogram), a plain one's all of them, which
    the EMA mode would read as one interval: refuse either in the other."""
    lo, pending = state_dict.get(prefix + "ema_lo"), state_dict.get(prefix + "pending")
    if any(t is not None and t.is_meta for t in (lo, pending)):
        return
    # an EMA state averaged (ema_lo) or has an interval pending; a plain one neither
    averaged = (lo is not None and bool(lo.numel())) or (pending is not None and int(pending) > 0)
    if not averaged and saved_shape(state_dict, prefix) is None:
        return  # nothing observed: either mode's empty state
    ema = saved.get("ema", None if lo is None else averaged)  # before the entry: the buffers
    if ema is not None and ema != mine:
        what = ("accumulating (averaging_constant=None)",
                "in the EMA mode (averaging_constant set: a range averaged over intervals)")
        raise ValueError(f"{who}: cannot load a histogram state {what[ema]} into this one, "
                         f"{what[mine]}; load it into an observer of the same mode")


def _described(layout: str, record: dict) -> str:
    order = record.get("order")
    return repr(layout) + (f" (g_idx column order {order})" if order else "")
