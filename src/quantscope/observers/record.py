"""What a saved observer state means, saved with it as ``_extra_state``: the layout its units
follow and, for histograms, whether they bin ``|x|`` (a subclass adds its own entries). A
state of another meaning is a ``ValueError`` naming both, not silently wrong qparams; a state
saved before the record loads as then. The record is JSON in a uint8 tensor, so a state stays
all tensors (safetensors and ``torch.load(weights_only=True)`` read it) and is parsed, never
unpickled."""

from __future__ import annotations

import json

import torch

from ..layout import Layout, parse_layout

__all__ = ["RECORD", "check", "decode", "encode", "saved_shape"]

RECORD = "_extra_state"  # torch's key of get_extra_state's value


def encode(record: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(record, sort_keys=True).encode()),
                            dtype=torch.uint8)


def decode(state, who: str) -> dict | None:
    if not isinstance(state, torch.Tensor) or state.is_meta:
        return None  # no record (saved before it: loads as then), or one on meta
    try:
        record = dict(json.loads(bytes(state.reshape(-1).tolist())))
    except (ValueError, TypeError):
        record = {"layout": None}  # unreadable: refused below, as a damaged entry
    if isinstance(record.get("layout", ""), str) and \
            isinstance(record.get("absolute", False), bool):
        return record
    raise ValueError(f"{who}: the state's {RECORD} is no record")


def saved_shape(state_dict, prefix) -> tuple[int, ...] | None:
    """The shape a saved observer state last observed (None: nothing observed, or unreadable)."""
    tokens, shape = (state_dict.get(prefix + k) for k in ("observed_tokens", "observed_shape"))
    if tokens is None or shape is None or tokens.is_meta or shape.is_meta or not int(tokens):
        return None
    return tuple(shape.tolist())


def check(state_dict, prefix, mine: dict, layout: Layout, who: str) -> None:
    """``ValueError`` naming both for a state saved under a layout of other units for the
    saved shape, or binning ``|x|`` where this one (``mine``, ``layout``) bins ``x``, or the
    reverse."""
    saved = decode(state_dict.get(prefix + RECORD), who)
    if saved is None:
        return
    other, shape = saved.get("layout", mine["layout"]), saved_shape(state_dict, prefix)
    if other != mine["layout"] and shape is not None and \
            not parse_layout(other).same_units(layout, shape):
        raise ValueError(f"{who}: cannot load a state saved under layout {other!r}; this "
                         f"observer's layout is {mine['layout']!r}")
    if "absolute" in mine and saved.get("absolute", mine["absolute"]) != mine["absolute"]:
        what = ("x (asymmetric)", "|x| (symmetric)")
        raise ValueError(f"{who}: cannot load a histogram of {what[saved['absolute']]} into "
                         f"this one's, of {what[mine['absolute']]}")
