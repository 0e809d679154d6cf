"""Weight fingerprints: whether a model holds, bit for bit, the weights a calibration was made
on (or every rank of a process group the same ones).

A weight's digest reads its bits in its logical order as signed 32-bit words (the last one
padded with zero bytes), laid out in rows of 8192: each row's hash is ``h_r = sum_c a_c x_rc``
and the digest's two sums ``sum_r b_r h_r`` and ``sum_r b'_r h_r``, all mod 2**64, with fixed
pseudo-random keys (:func:`_keys`: odd, the column keys ``a_c`` below 2**32 and distinct, the
row keys ``b_r``, ``b'_r`` 64-bit). Integer sums are exact in any order, so weights identical
bit for bit give the same digest on any device and thread count. A change of one word (any
one bit) always changes both sums (``a_c d`` is below 2**64 and not 0; the row keys are odd),
and so do two words of a row swapped (``(a_c - a_e) d``) or both their sign bits flipped
(``2**31 (a_c +- a_e)``, which cancel on 64-bit words: ``2**63 + 2**63``): the column keys
are distinct. Any other change (values or rows swapped, a transpose, a fine-tuned or another
model's weights) escapes by chance only, of the order of 2**-32 for each sum where a few
words changed: there is no position period or low-degree pattern to line up with (a digest
weighting words by position mod P missed values P words apart swapped). It is no
cryptographic hash: a change made to collide can. One pass over the weight computes it (a
matrix-vector product of its rows, in uint64: numpy's on the CPU, in chunks within the
caches; torch's elsewhere).

``calibrate`` records, on each role it calibrated values of (static, or ``"local"``: NVFP4's
global scale, from the amax seen), the :func:`fingerprint` of the weight those values came
through (:func:`source`): a weight's own; an input's or output's, its layer's weight (``x``
entering it, ``x W^T`` leaving it); the KV cache's keys' and values', the projection that
makes them (``k_proj`` / ``v_proj`` / ``qkv_proj``) (``RoleState.fingerprint``, saved with
the calibration); :func:`check_fingerprints` (``Calibration.check_model``: apply and every
export) compares the model's. An activation's range also depends on every weight before it
(norms, embeddings, earlier layers): those are not fingerprinted (the guide's "Saving and
loading" says why). The distributed weight check compares the ranks' :func:`digest` s
(:func:`~..run.gather.check_same_weights`).
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from ..._checks import outside_quantscope
from . import kv_cache
from .expert_views import view_weight
from .placement import plain

__all__ = ["check_fingerprint_text", "check_fingerprints", "digest", "fingerprint",
           "fingerprint_text", "layer_weight", "record_fingerprints", "source", "sources"]

#: the words of a row (module doc)
_COLUMNS = 8192
#: rows converted to int64 at a time: 4 MiB on the CPU (within the caches), 64 MiB elsewhere
_CPU_STEP, _STEP = 64, 1024
#: a digest's sums as 64-bit two's complement, in the text
_MASK = (1 << 64) - 1
_TEXT = re.compile(r"([a-z0-9_]+):([0-9a-f]{32})")


def _mix(i: np.ndarray) -> np.ndarray:
    """uint64: splitmix64's output number ``i + 1`` (its seed 0): fixed pseudo-random keys."""
    with np.errstate(over="ignore"):
        z = (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.cache
def _column_keys() -> np.ndarray:
    """``[8192]`` uint64 ``a_c``: odd, below 2**32, distinct (a test checks)."""
    return (_mix(np.arange(_COLUMNS, dtype=np.uint64)) >> np.uint64(32)) | np.uint64(1)


def _keys(rows: int) -> np.ndarray:
    """``[2, rows]`` uint64: the row keys ``b_r``, ``b'_r`` (odd), drawn after the columns'."""
    i = np.arange(2 * rows, dtype=np.uint64).reshape(rows, 2).T
    return _mix(i + np.uint64(1 << 32)) | np.uint64(1)


def _words(w: torch.Tensor) -> torch.Tensor:
    """``w``'s bits as signed 32-bit words in its logical order, the last padded with zero
    bytes (a view where ``w`` is contiguous and its bytes start on a word)."""
    flat = w.detach().contiguous().reshape(-1)
    if flat.storage_offset() * flat.element_size() % 4:
        flat = flat.clone()
    b = flat.view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(-b.numel() % 4)])
    return b.view(torch.int32)


def digest(w: torch.Tensor) -> torch.Tensor:
    """``[2]`` int64 on ``w``'s device: the two sums of the module doc (two's complement of
    the uint64); no host synchronisation."""
    x = _words(w)
    rows = -(-x.numel() // _COLUMNS)
    if x.device.type == "cpu":
        with np.errstate(over="ignore"):
            sums = (_keys(rows) * _row_hashes(x.numpy())).sum(1, dtype=np.uint64)
        return torch.from_numpy(sums.view(np.int64))
    keys = torch.from_numpy(_keys(rows).view(np.int64)).to(x.device)
    return (keys * _torch_row_hashes(x)).sum(1)


def _row_hashes(x: np.ndarray, step: int = _CPU_STEP) -> np.ndarray:
    """``[rows]`` uint64 ``h_r`` of int32 words ``x``: numpy's uint64 matrix-vector product
    (wrapping by definition; torch's has no uint64 kernel), ``step`` rows converted at a time
    into one buffer within the caches (a whole weight's int64 copy, or one allocated per chunk
    as :func:`_torch_row_hashes` does, was 2-5x slower on two busy cores)."""
    a, whole = _column_keys(), x.size - x.size % _COLUMNS
    full = x[:whole].reshape(-1, _COLUMNS)
    out = np.empty(-(-x.size // _COLUMNS), dtype=np.uint64)
    buf = np.empty((min(step, len(full)), _COLUMNS), dtype=np.int64)
    for r in range(0, len(full), step):
        k = min(step, len(full) - r)
        np.copyto(buf[:k], full[r:r + k])  # sign-extended: x mod 2**64
        np.dot(buf[:k].view(np.uint64), a, out=out[r:r + k])
    if whole < x.size:
        out[-1] = x[whole:].astype(np.int64).view(np.uint64) @ a[:x.size - whole]
    return out


def _torch_row_hashes(x: torch.Tensor, step: int = _STEP) -> torch.Tensor:
    """:func:`_row_hashes` with torch, on a GPU: int64 products (below 2**63: exact), sums
    wrapping as uint64's do."""
    a = torch.from_numpy(_column_keys().view(np.int64)).to(x.device)
    whole = x.numel() - x.numel() % _COLUMNS
    full = x[:whole].view(-1, _COLUMNS)
    parts = [(full[r:r + step].long() * a).sum(1) for r in range(0, len(full), step)]
    if whole < x.numel():
        parts.append((x[whole:].long() * a[:x.numel() - whole]).sum().view(1))
    return torch.cat(parts) if parts else a.new_zeros(0)


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


def source(model: nn.Module, layer: str, role: str) -> str | None:
    """The layer whose weight the values of ``layer``'s ``role`` came through: ``layer`` for
    its weight, input or output; for the KV cache's ``"key"`` / ``"value"`` the attention's
    projection making them (:func:`~.kv_cache.projection`); None where ``model`` has none."""
    if role not in kv_cache.ROLES:
        return layer
    try:
        attention = model.get_submodule(layer)
    except AttributeError:
        return None
    child = kv_cache.projection(attention, role)
    return None if child is None else f"{layer}.{child}"


def sources(model: nn.Module, states: dict) -> set[str]:
    """The layers whose weights the fingerprinted states of ``states`` were taken of."""
    return {source(model, layer, role) for layer, roles in states.items()
            for role, st in roles.items() if st.fingerprint is not None} - {None}


def record_fingerprints(model: nn.Module, calibrations) -> None:
    """Give each calibrated state of ``calibrations`` (states ``{layer: {role: RoleState}}``,
    changed in place; each state replaced: other calibrations may hold it) the
    :func:`fingerprint` of the weight of ``model`` its values came through (:func:`source`;
    one pass per weight for all): static ones, and ``"local"`` ones, whose global scale the
    amax set (another weight's values would clip to it); a run-time (``dynamic=True``) scale
    follows its tensor."""
    seen = {}
    for states in calibrations:
        for layer, roles in states.items():
            for role, st in list(roles.items()):
                if st.dynamic is True:
                    continue
                owner = source(model, layer, role)
                if owner not in seen:
                    w = None if owner is None else layer_weight(model, owner)
                    seen[owner] = None if w is None else fingerprint(w)
                roles[role] = replace(st, fingerprint=seen[owner])


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
    """Raise ``ValueError`` naming the first weight of ``model`` that differs from the one a
    state's fingerprint was taken of (:func:`source`; a weight of another shape:
    :meth:`RoleState.check_weight`'s error). A weight in another dtype is compared cast to the
    calibrated one: a wider copy of it (or the original a narrower calibrated copy was rounded
    from) matches; a narrower copy cannot be told from another model's and is not checked
    (one warning says so). States without a fingerprint (a calibration saved before they were
    recorded, or read from a checkpoint) and the weights of the layers in ``skip`` are not
    checked; nor is a model lacking a calibrated layer, whose module apply and the exports
    name. Each weight is read once, however many states were calibrated through it."""
    found = {}
    for layer, roles in states.items():
        for role, st in roles.items():
            owner = None if st.fingerprint is None else source(model, layer, role)
            if st.fingerprint is None or owner in skip:
                continue
            w = None if owner is None else layer_weight(model, owner)
            if w is None and _lacks(model, layer):
                return
            if w is not None and not w.is_meta:
                if role == "weight":
                    st.check_weight(who, layer, w)  # another shape anywhere says more: first
                found.setdefault((owner, st.fingerprint), (role, w))
    narrower = []
    for (owner, text), (role, w) in found.items():
        dtype = getattr(torch, text.partition(":")[0])
        if fingerprint(w.to(dtype)) == text:
            continue
        if not _holds(w.dtype, dtype):
            narrower.append((owner, w.dtype, dtype))
            continue
        raise ValueError(f"{who}: {owner}.weight is not the weight calibrated (its bits differ "
                         f"from the fingerprint calibrate recorded{_for(role)}): the model was "
                         f"re-saved, fine-tuned, or smoothed in place by a later calibrate("
                         f"outliers=Outliers(smooth=...)) since, or is another checkpoint of the "
                         f"same shapes; pass the model calibrated, or calibrate this one (to use "
                         f"these scales all the same, on weights not smoothed since: "
                         f"calibration.without_fingerprints(), --allow-other-weights)")
    if narrower:
        layer, got, want = narrower[0]
        warnings.warn(f"{who}: {len(narrower)} weights (first {layer}.weight) are {got}, "
                      f"narrower than the {want} calibrated: a rounded copy cannot be told "
                      f"from another model's by their fingerprints, so they were not checked",
                      stacklevel=outside_quantscope())


def _for(role: str) -> str:
    """Which scales a weight's fingerprint was recorded for, where not its own."""
    if role == "weight":
        return ""
    return f" for the {role} cache's scales" if role in kv_cache.ROLES else \
        f" for its {role} scales"
