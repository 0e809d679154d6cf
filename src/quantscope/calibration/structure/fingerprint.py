"""Weight fingerprints: whether a model holds, bit for bit, the weights a calibration was made
on (or every rank of a process group the same ones).

A weight's digest is two integer sums over its bits, read as signed 16-bit words (8-bit ones
for a 1-byte dtype) in its logical order: their sum, and their sum weighted by ``1 + position
mod 8191`` (a prime: rows of any length start on other weights, so swapped rows, or a
transposed square matrix, change it). Integer sums are exact in any order, so weights
identical bit for bit give the same digest on any device and thread count; one reduction
over the weight computes it (the words summed per position class, in int64: no sum
overflows below 2**35 words). It tells a model re-saved, fine-tuned or swapped for another of
the same shapes from the one calibrated; it is no cryptographic hash.

``calibrate`` records each static weight's :func:`fingerprint` (``RoleState.fingerprint``,
saved with the calibration); :func:`check_fingerprints` (``Calibration.check_model``: apply
and every export) compares the model's. The distributed weight check compares the ranks'
:func:`digest` s (:func:`~..run.gather.check_same_weights`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from ..._checks import outside_quantscope
from .moe import view_weight
from .placement import plain

__all__ = ["check_fingerprint_text", "check_fingerprints", "digest", "fingerprint",
           "fingerprint_text", "layer_weight", "record_fingerprints"]

#: the period of the position weights (a prime)
_PERIOD = 8191
#: a digest's sums as 64-bit two's complement, in the text
_MASK = (1 << 64) - 1
_TEXT = re.compile(r"([a-z0-9_]+):([0-9a-f]{32})")


def _words(w: torch.Tensor) -> torch.Tensor:
    """``w``'s bits as signed words of at most 16 bits, in its logical order (a view where
    ``w`` is contiguous)."""
    flat = w.detach().contiguous().reshape(-1)
    return flat.view(torch.int8 if flat.element_size() == 1 else torch.int16)


def digest(w: torch.Tensor) -> torch.Tensor:
    """``[2]`` int64 on ``w``'s device: ``sum(b)`` and ``sum((1 + i mod 8191) * b)`` over the
    words ``b`` of ``w``'s bits (module doc); no host synchronisation."""
    b = _words(w)
    n = b.numel()
    whole = n - n % _PERIOD
    acc = _column_sums(b[:whole].view(-1, _PERIOD))  # acc[k]: the words at positions k mod P
    acc[:n - whole] += b[whole:]
    weights = torch.arange(1, _PERIOD + 1, dtype=torch.int64, device=b.device)
    return torch.stack([acc.sum(), (acc * weights).sum()])


def _column_sums(rows: torch.Tensor) -> torch.Tensor:
    """``[columns]`` int64: the sums of ``rows``' columns. On the CPU numpy's, which converts
    in small buffers on the calling thread: torch converts a whole int16 input to int64
    first, and in chunks small enough for the caches opens a parallel region per chunk, which
    two busy cores made 10-40x slower. Elsewhere torch's (:func:`_torch_column_sums`)."""
    if rows.device.type == "cpu":
        return torch.from_numpy(rows.numpy().sum(axis=0, dtype=np.int64))
    return _torch_column_sums(rows)


def _torch_column_sums(rows: torch.Tensor, step: int = 1024) -> torch.Tensor:
    """:func:`_column_sums` on a GPU: ``step`` rows converted and summed at a time."""
    acc = torch.zeros(rows.shape[1], dtype=torch.int64, device=rows.device)
    for r in range(0, rows.shape[0], step):
        acc += rows[r:r + step].sum(0, dtype=torch.int64)
    return acc


def fingerprint_text(dtype: str, sums) -> str:
    """``"<dtype>:<32 hex digits>"``: a dtype's name and the two sums of a :func:`digest`."""
    return f"{dtype}:" + "".join(f"{int(s) & _MASK:016x}" for s in sums)


def fingerprint(w: torch.Tensor) -> str | None:
    """``"<dtype>:<32 hex digits>"``: ``w``'s dtype and :func:`digest`; None for a tensor on
    the meta device (no data)."""
    return None if w.is_meta else fingerprint_text(str(w.dtype).removeprefix("torch."),
                                                   digest(w).tolist())


def check_fingerprint_text(text) -> str | None:
    """``text`` (None, or what :func:`fingerprint` writes: a saved calibration's), checked;
    ``ValueError`` for anything else."""
    if text is None:
        return None
    m = _TEXT.fullmatch(text) if isinstance(text, str) else None
    if m is None or not isinstance(getattr(torch, m.group(1), None), torch.dtype):
        raise ValueError(f"expected null or a torch dtype's name, a colon and 32 hex digits "
                         f"(a weight's fingerprint), got {text!r}")
    return text


def layer_weight(model: nn.Module, layer: str) -> torch.Tensor | None:
    """The weight a state of ``layer`` quantizes in ``model``: the tensor its module holds, or
    an expert slice of a 3-D experts module (:func:`~.moe.attach`'s names, attached or not);
    None where ``model`` has neither, or the weight is computed at each forward (pruning, a
    parametrization) or no dense tensor (torchao's codes and scales, a DTensor): apply and
    the exports refuse those themselves, saying so."""
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        return view_weight(model, layer)
    w = module._parameters.get("weight", module._buffers.get("weight"))
    return w if isinstance(w, torch.Tensor) and plain(w) else None


def _lacks(model: nn.Module, layer: str) -> bool:
    """Whether ``model`` has no module ``layer`` (nor an expert slice by that name)."""
    try:
        model.get_submodule(layer)
    except AttributeError:
        return view_weight(model, layer) is None
    return False


def record_fingerprints(model: nn.Module, states: dict, seen: dict) -> None:
    """Give each static weight state of ``states`` (``{layer: {role: RoleState}}``, changed
    in place; each state replaced: other calibrations may hold it) the :func:`fingerprint`
    of the weight ``model`` holds for it; ``seen``: ``{layer: fingerprint}`` already taken
    (one pass per weight for all the recipes of a calibration)."""
    for layer, roles in states.items():
        st = roles.get("weight")
        if st is None or st.dynamic is not False:  # a run-time scale follows the weight
            continue
        if layer not in seen:
            w = layer_weight(model, layer)
            seen[layer] = None if w is None else fingerprint(w)
        roles["weight"] = replace(st, fingerprint=seen[layer])


def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of ``narrow`` is one of ``wide`` (a cast there and back exact)."""
    if wide == narrow:
        return True
    if not (wide.is_floating_point and narrow.is_floating_point):
        return False
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return (w.eps <= n.eps and w.max >= n.max
            and w.smallest_normal * w.eps <= n.smallest_normal * n.eps)  # the subnormals


def check_fingerprints(model: nn.Module, states: dict, who: str, skip=frozenset()) -> None:
    """Raise ``ValueError`` naming the first weight of ``model`` that differs from the one its
    state's fingerprint was taken of (another shape: :meth:`RoleState.check_weight`'s error).
    A weight in another dtype is compared cast to the calibrated one: a wider copy of it (or
    the original a narrower calibrated copy was rounded from) matches; a narrower copy cannot
    be told from another model's and is not checked (one warning says so). States without a
    fingerprint (a calibration saved before they were recorded, or read from a checkpoint)
    and the layers in ``skip`` are not checked; nor is a model lacking a calibrated layer,
    whose module apply and the exports name."""
    found = []
    for layer, roles in states.items():
        st = roles.get("weight")
        if st is None or st.fingerprint is None or layer in skip:
            continue
        w = layer_weight(model, layer)
        if w is None and _lacks(model, layer):
            return
        if w is not None and not w.is_meta:
            st.check_weight(who, layer, w)  # another shape anywhere says more: first
            found.append((layer, st, w))
    narrower = []
    for layer, st, w in found:
        dtype = getattr(torch, st.fingerprint.partition(":")[0])
        if fingerprint(w.to(dtype)) == st.fingerprint:
            continue
        if not _holds(w.dtype, dtype):
            narrower.append((layer, w.dtype, dtype))
            continue
        raise ValueError(f"{who}: {layer}.weight is not the weight calibrated (its bits differ "
                         f"from the fingerprint calibrate recorded): the model is not the one "
                         f"this calibration was made on (re-saved or fine-tuned since, or "
                         f"another checkpoint of the same shapes), and the calibrated scales "
                         f"would clip or waste its range; pass the model that was calibrated, "
                         f"or calibrate this one")
    if narrower:
        layer, got, want = narrower[0]
        warnings.warn(f"{who}: {len(narrower)} weights (first {layer}.weight) are {got}, "
                      f"narrower than the {want} calibrated: a rounded copy cannot be told "
                      f"from another model's by their fingerprints, so they were not checked",
                      stacklevel=outside_quantscope())
