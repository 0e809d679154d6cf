"""Per-unit min and max: the one pass over the data every observer makes.

torch reduces a whole tensor (``torch.aminmax(x)``) in one vectorized read, but
per-row reductions are slower: ``torch.aminmax(u, dim=1)`` is not vectorized
(6-9x the whole-tensor time on CPU) and ``amin`` + ``amax`` read the data twice.
On CPU, for large contiguous float32, bf16 or fp16 units, :func:`unit_minmax` therefore
runs a small C kernel (one read, both extremes, NaN propagated, threads over units or over
one unit's elements; bf16 / fp16 widened exactly as they are read, never copied to float32),
compiled on first use by :mod:`quantscope.kernels`; for small inputs too where an observer's
step also wants their ends or a state update (its one pass stands for a dozen small torch
ops). Without a compiler, for other small inputs, or with ``QUANTSCOPE_NO_KERNEL=1`` it uses
torch; both give identical results (tests compare them bitwise), up to the sign of a zero
extreme: where -0.0 and +0.0 tie for a unit's min or max, which comes back depends on the
vector width and the thread split (torch's too; they compare equal and give the same
qparams). Off the CPU it calls the op
``quantscope::unit_minmax`` (:mod:`quantscope.kernels.ops`: one Triton read on CUDA, bf16 /
fp16 read as they are, and the layouts whose units are no row view read in place:
:mod:`.minmax_layouts`).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.graph import increment_version

from .. import kernels
from .._checks import check_number
from .._oplib import define
from ..kernels import ops
from ..kernels import triton as _triton

__all__ = ["KERNEL_DTYPES", "MINMAX_DTYPES", "any_non_finite", "ema_", "extreme_ends",
           "holds_non_finite", "kernel_pass", "minmax_observe", "minmax_update",
           "op_unit_count", "op_units", "ordered", "record_ends", "record_non_finite",
           "torch_unit_minmax", "unit_minmax", "zero_non_finite"]

#: below this many elements torch's per-row reduction is as fast as a kernel call
KERNEL_MIN_NUMEL = 1 << 16


def _kernel():
    return kernels.lib("unit_minmax")


def torch_unit_minmax(units: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`unit_minmax` (any device, any float dtype), in the
    units' dtype: :func:`unit_minmax` returns bf16 / fp16 results widened to float32."""
    if units.shape[0] == 1:  # a full reduction is much faster than one along a dim
        lo, hi = torch.aminmax(units)
        if out is None:
            return lo.reshape(1), hi.reshape(1)
        out[0].copy_(lo)  # (0-dim into [1]: a broadcast, no reshape)
        out[1].copy_(hi)
        return out
    if units.device.type == "cpu" and not units.is_contiguous():
        # strided units (a slice, a transposed view): amin and amax vectorize along the
        # memory where aminmax(dim=1) walks element by element (6x slower, found by probing)
        lo, hi = (None, None) if out is None else out
        return torch.amin(units, 1, out=lo), torch.amax(units, 1, out=hi)
    if out is None:
        return torch.aminmax(units, dim=1)
    torch.aminmax(units, dim=1, out=out)
    return out


#: elements per extra thread: starting and joining a thread costs about as much as reading
#: ~4M float32 here (measured: 1 thread beats 2 up to 4M elements, 2 win from 8M)
THREAD_MIN_NUMEL = 1 << 22


def _threads(numel: int, rows: int) -> int:
    if numel < 2 * THREAD_MIN_NUMEL:  # one thread (the common call: no torch query)
        return 1
    return max(1, min(kernels.threads(), rows, numel // THREAD_MIN_NUMEL))


#: the element types the C kernel reads, by its code (csrc/unit_minmax.c)
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: the float dtypes every per-unit min / max path reads as they are: the C kernel on the
#: CPU, the ops off it (min / max of bf16 / fp16 values are exact in float32); the
#: histogram binning reads the same ones
MINMAX_DTYPES = tuple(KERNEL_DTYPES)


def _use_kernel(x: torch.Tensor) -> bool:
    return (x.dtype in KERNEL_DTYPES and x.numel() >= KERNEL_MIN_NUMEL and not x.requires_grad
            and kernels.plain(x, x.dtype))


def _kernel_reads(units: torch.Tensor, step: bool) -> bool:
    """Whether :func:`unit_minmax` reads ``units [U, E]`` with the C kernel: many units of
    many elements (torch's per-row reduction is the slower there), and every small input of
    an observer's ``step`` (ends or a state update wanted: the kernel's one pass stands for
    a dozen small torch ops, whose dispatch outweighs the data). One large float32 unit
    too: its one pass takes 0.6x ``torch.aminmax``'s time on one thread (64K elements, ctypes
    call included, measured on an EPYC), and splits the unit's elements over its threads from
    ``2 * THREAD_MIN_NUMEL``; between, where the kernel's one thread meets torch's pool of
    several, torch."""
    if not (units.is_cpu and units.dtype in KERNEL_DTYPES and units.is_contiguous()
            and not units.requires_grad):
        return False
    numel = units.numel()
    small = numel < KERNEL_MIN_NUMEL
    if units.shape[0] == 1 and not small:
        if units.dtype != torch.float32:
            return False  # one large half unit: torch's whole-tensor read is as fast
        return not THREAD_MIN_NUMEL <= numel < 2 * THREAD_MIN_NUMEL or kernels.threads() == 1
    return step or not small


def _result_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of per-unit min / max of ``dtype`` units: float32 for the kernel's element
    types (exact: a bf16 / fp16 value is a float32), the units' own otherwise."""
    return torch.float32 if dtype in KERNEL_DTYPES else dtype


def _torch_minmax_f32(units: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`torch_unit_minmax` on the CPU with :func:`unit_minmax`'s result dtype: half
    units reduce in their own dtype and only the results widen (not the data)."""
    if units.dtype == _result_dtype(units.dtype):
        return torch_unit_minmax(units, out)
    lo, hi = torch_unit_minmax(units)
    if out is None:
        return lo.float(), hi.float()
    out[0].copy_(lo)
    out[1].copy_(hi)
    return out


#: state updates :func:`unit_minmax` can fuse into its pass (see :func:`update_state`)
UPDATES = {"min": 1, "ema": 2, "ema_lerp": 3}


def update_state(kind: str, c: float, state_lo: torch.Tensor, state_hi: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Update per-unit min / max state in place from a batch's ``lo`` / ``hi`` (overwritten).

    ``"min"``: running min / max; ``"ema"``: ``s + c * (b - s)`` (torch.ao's expression);
    ``"ema_lerp"``: ``s * (1 - c) + b * c`` (llm-compressor's). The compiled kernel fuses
    the same updates into its pass, rounded identically (tests compare them bitwise). Off the
    CPU the op ``quantscope::minmax_update`` does it (one Triton launch on CUDA).
    """
    if kind in UPDATES and lo.device.type != "cpu" and lo.dim() == 1 \
            and all(t.dtype == torch.float32 and t.shape == lo.shape and t.is_contiguous()
                    for t in (hi, state_lo, state_hi)) and lo.dtype == torch.float32:
        minmax_update(lo, hi, state_lo, state_hi, UPDATES[kind], c)
        return
    _update_state(kind, c, state_lo, state_hi, lo, hi)


def _update_state(kind, c, state_lo, state_hi, lo, hi) -> None:
    """:func:`update_state` in torch."""
    if kind == "min":
        torch.minimum(state_lo, lo, out=state_lo)
        torch.maximum(state_hi, hi, out=state_hi)
    elif kind in ("ema", "ema_lerp"):
        ema_(kind, c, state_lo, lo)
        ema_(kind, c, state_hi, hi)
    else:
        raise ValueError(f"update_state: unknown kind {kind!r}; expected one of {list(UPDATES)}")


def ema_(kind: str, c: float, state: torch.Tensor, batch: torch.Tensor) -> None:
    """One moving-average step of ``state`` towards ``batch`` (overwritten), in place:
    ``"ema"`` ``s + c * (b - s)`` or ``"ema_lerp"`` ``s * (1 - c) + b * c``, rounded as
    :func:`update_state` (and the kernel) round them."""
    if kind == "ema":
        state.add_(batch.sub_(state).mul_(c))
    elif kind == "ema_lerp":
        state.mul_(1.0 - c).add_(batch.mul_(c))
    else:
        raise ValueError(f"ema_: unknown kind {kind!r}; expected 'ema' or 'ema_lerp'")


def ordered(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each unit's ends in order. The ``"ema"`` step ``s + c * (b - s)`` is not monotonic in
    ``s``: two ends a rounding step apart can cross by that step (torch.ao's own observer then
    fails an assert), though the exact averages are ordered; in order, they bound it."""
    return torch.minimum(lo, hi), torch.maximum(lo, hi)


def extreme_ends(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``(2,)``: the smallest and the largest of the per-unit mins ``lo`` and maxes ``hi``
    together (NaN propagates): the smallest min and largest max where each ``lo <= hi``, and
    not finite exactly where some ``lo`` / ``hi`` is, as the Triton ``record_non_finite``
    tests them (a ``lo`` of +inf a caller's ``lo > hi`` holds too); one op for one unit."""
    if lo.numel() == 1:
        return torch.cat((lo, hi) if lo.dim() == 1 else (lo.reshape(1), hi.reshape(1)))
    (a, b), (c, d) = lo.aminmax(), hi.aminmax()  # (a cat, a copy of both: 3x their reads)
    return torch.stack((torch.minimum(a, c), torch.maximum(b, d)))


def any_non_finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool, no host read: ``t`` holds a NaN or an inf. ``x - x`` is NaN exactly there:
    three small ops where ``~isfinite(t).all()`` takes eight (per observer call)."""
    return t.sub(t).isnan().any()


def holds_non_finite(t: torch.Tensor) -> bool:
    """``t`` (floating, not meta) holds a NaN or an inf, by one host read: its min and max
    are finite exactly where every value is (NaN propagates through both), so
    :func:`any_non_finite` of those two. One read pass and no temporary of ``t``'s size: 7x
    faster than ``isfinite(t).all()`` on a large batch."""
    return t.numel() > 0 and bool(any_non_finite(torch.stack(torch.aminmax(t))))


def zero_non_finite(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t with NaN / inf read as 0, how many: 0-dim)``, no host read: what
    ``non_finite="ignore"`` reads (zero lies inside every range), for the observers and for
    what is gathered beside them (``auto``'s input importance)."""
    bad = ~torch.isfinite(t)
    return t.masked_fill(bad, 0.0), bad.sum()


def record_ends(ends: torch.Tensor, seen: torch.Tensor) -> None:
    """``seen |= `` the ``(2,)`` float32 ``ends`` (:func:`extreme_ends`) hold a NaN or an
    infinity: read from the host where they can be (an eager CPU tensor: no tensor op, and
    the usual answer is no), else by :func:`any_non_finite` (no host read)."""
    if (values := kernels.read(ends, 2, strict=False)) is not None:
        if not all(map(math.isfinite, values)):
            seen.fill_(True)
    else:
        seen.bitwise_or_(any_non_finite(ends))  # (|= on a buffer would setattr it back)


def _takes_out(out, U: int, units: torch.Tensor) -> bool:
    """Whether ``out`` can take :func:`unit_minmax`'s results for ``U`` units."""
    lo, hi = out
    dtype = _result_dtype(units.dtype)
    if lo.shape != (U,) or hi.shape != (U,) or lo.dtype != dtype or hi.dtype != dtype:
        return False
    # (is_cpu: a device object per test costs a microsecond here)
    same = lo.is_cpu and hi.is_cpu if units.is_cpu else lo.device == units.device == hi.device
    return same and lo.is_contiguous() and hi.is_contiguous()


def unit_minmax(units: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                ends: torch.Tensor | None = None, update: tuple | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Min and max of every row of ``units [U, E]`` as two ``[U]`` tensors (NaN propagates):
    float32 for float32 / bf16 / fp16 units, the units' dtype for others.

    ``out``: two ``[U]`` tensors to write into (observers pass their previous ones: fresh
    multi-megabyte outputs cost page faults that, for blocks of 8 or 16, take longer than
    the reduction itself). ``ends``: a ``(2,)`` float32 tensor that receives the smallest
    min and the largest max (NaN if any), which the non-finite check needs; the kernel
    gets them in the same pass. ``update``: ``(kind, c, state_lo, state_hi)``, a state
    update (:func:`update_state`) applied after the min / max are taken, in the same pass
    on the kernel path; the returned ``lo`` / ``hi`` are then scratch, and where ``ends`` is
    given too the kernel path writes none: ``(None, None)`` (the state and ``ends`` hold all
    the call keeps; writing them would cost as much as the reads for short rows).

    A caller's tensor the call writes (``out``, ``ends``, the state) has its version counter
    bumped on either path, as in-place torch ops would: one autograd saved then raises.
    """
    U, E = units.shape
    if E == 0:  # (the C kernels divide their rows by E; torch raises an IndexError)
        raise ValueError(f"unit_minmax: units must have elements (a min / max of each row of "
                         f"[units, elements]), got shape {tuple(units.shape)}")
    if out is not None and not _takes_out(out, U, units):
        out = None
    step = ends is not None or update is not None
    lib = None
    # (the cheap tests first: a hot path) the kernel's inputs and outputs must be plain CPU
    # float32 of its shapes, and have memory (not a fake, a vmap tensor or a trace: real())
    if _kernel_reads(units, step) and (ends is None or kernels.flat_f32(2, ends)) and (
            update is None or kernels.flat_f32(U, *update[2:])) and \
            kernels.real(units, *(out or ()), *(() if update is None else update[2:]),
                         *(() if ends is None else (ends,))):
        lib = _kernel()
    if lib is None:
        # on the CPU torch itself: the op's dispatch (~11 us) outweighs a small reduction
        lo, hi = _torch_minmax_f32(units, out) if units.is_cpu else ops.unit_minmax(units)
        if ends is not None:
            ends.copy_(extreme_ends(lo, hi))
        if update is not None:
            update_state(update[0], update[1], update[2], update[3], lo, hi)
        return lo, hi
    if update is not None and ends is not None:  # a fused update keeps no per-unit lo / hi
        lo = hi = lo_p = hi_p = None
    else:
        lo, hi = out if out is not None else (kernels.buffer(U), kernels.buffer(U))
        lo_p, hi_p = lo.data_ptr(), hi.data_ptr()
    scratch = ends if ends is not None else kernels.buffer(2)
    if update is None:
        mode, c, slo, shi, written = 0, 0.0, None, None, (lo, hi)
    else:
        kind, c, slo, shi = update
        mode, c = UPDATES[kind], float(c)
        written = (slo, shi) if lo is None else (lo, hi, slo, shi)
        slo, shi = slo.data_ptr(), shi.data_ptr()
    kernel_pass(lib, units.data_ptr(), U, E, lo_p, hi_p, scratch.data_ptr(), mode, c, slo, shi,
                KERNEL_DTYPES[units.dtype])
    # written by the C, as in-place torch ops would (one call); the caller's ends too
    increment_version(written if ends is None else (*written, ends))
    return lo, hi


def kernel_pass(lib, x: int, U: int, E: int, lo: int | None, hi: int | None, ends: int,
                mode: int, c: float, state_lo: int | None, state_hi: int | None,
                code: int) -> None:
    """The C min / max pass over ``U`` rows of ``E`` at address ``x`` (:func:`unit_minmax`'s, the
    cached observer step's): one thread rule (one unit: its elements split over them); ``lo``
    / ``hi`` None: a state update (``mode``) keeps no per-unit min / max."""
    lib.qs_unit_minmax(x, U, E, lo, hi, ends, _threads(U * E, U if U > 1 else E), mode, c,
                       state_lo, state_hi, code)


def op_units(x: torch.Tensor, layout) -> torch.Tensor | None:
    """``x``'s units as the op ``quantscope::unit_minmax`` reads them: ``[U, E]``, or
    ``[U1, U2, E1, E2]`` where they are no row view (a channel axis after the first, tiles),
    in ``x``'s own float dtype; None where the op cannot (other dtypes, autograd, no units)."""
    from ..layout import Channel, Tile

    if x.dtype not in MINMAX_DTYPES or x.requires_grad:
        return None
    shape = x.shape
    if isinstance(layout, Channel) and x.dim() >= 2:
        a = layout.axis % x.dim()
        A, C, B = math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])
        if A > 1:  # units (1, c), elements (a, b)
            return x.reshape(A, C, B).permute(1, 0, 2)[None]
    elif isinstance(layout, Tile) and x.dim() >= 2:
        R, C = shape[-2:]
        if R % layout.rows == 0 and C % layout.cols == 0:  # no padding: units (tile row, col)
            t = x.reshape(-1, layout.rows, C // layout.cols, layout.cols)
            return t.permute(0, 2, 1, 3)
    units = layout.to_units(x)
    return units if units.numel() else None


def op_unit_count(units: torch.Tensor) -> int:
    """How many units an :func:`op_units` view holds."""
    return units.shape[0] if units.dim() == 2 else units.shape[0] * units.shape[1]


# ---- an observer's step off the CPU: one op each ----------------------------------------------

def _check_ranges(who: str, lo: torch.Tensor, hi: torch.Tensor) -> None:
    if lo.dim() != 1 or lo.dtype != torch.float32 or hi.shape != lo.shape \
            or hi.dtype != torch.float32 or hi.device != lo.device:
        raise ValueError(f"quantscope::{who}: lo and hi must be float32 [n] tensors of one "
                         f"shape and device, got {lo.dtype} {tuple(lo.shape)} on {lo.device} "
                         f"and {hi.dtype} {tuple(hi.shape)} on {hi.device}")


def _check_kind(who: str, kind, c) -> None:
    """``kind`` an :data:`UPDATES` code; ``c`` (no device read) the observers' averaging
    constant, in (0, 1], for the moving averages, finite for ``"min"`` (unread: 0.0)."""
    if kind not in UPDATES.values():
        raise ValueError(f"{who}: kind must be one of {UPDATES}, got {kind}")
    if kind == UPDATES["min"]:
        check_number(who, "c", c, -math.inf)
    else:
        check_number(who, "c (the averaging constant)", c, 0.0, 1.0, lo_open=True)


def _check_update(lo, hi, state_lo, state_hi, kind, c) -> None:
    # (this check is the op's fake implementation too)
    who = "minmax_update"
    _check_ranges(who, lo, hi)
    _check_kind(f"quantscope::{who}", kind, c)
    for name, t in (("state_lo", state_lo), ("state_hi", state_hi)):
        if t.shape != lo.shape or t.dtype != torch.float32 or t.device != lo.device \
                or not t.is_contiguous():
            raise ValueError(f"quantscope::{who}: {name} must be a contiguous float32 tensor "
                             f"of lo's shape {tuple(lo.shape)} on {lo.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


def _torch_minmax_update(lo, hi, state_lo, state_hi, kind, c) -> None:
    _check_update(lo, hi, state_lo, state_hi, kind, c)
    names = {v: k for k, v in UPDATES.items()}
    _update_state(names[kind], c, state_lo, state_hi, lo.clone(), hi.clone())


def _cuda_minmax_update(lo, hi, state_lo, state_hi, kind, c) -> None:
    kernel = _triton.launchers("minmax", lo, writes=(state_lo, state_hi))
    if kernel is None:
        return _torch_minmax_update(lo, hi, state_lo, state_hi, kind, c)
    _check_update(lo, hi, state_lo, state_hi, kind, c)
    kernel.update_state(lo.contiguous(), hi.contiguous(), state_lo, state_hi, None, kind, c)
    return None


#: :func:`update_state` (``kind``: its :data:`UPDATES` code) as one op: one Triton launch on
#: CUDA where the torch ops take two to six, rounded alike.
minmax_update = define(
    "minmax_update(Tensor lo, Tensor hi, Tensor(a!) state_lo, Tensor(b!) state_hi, SymInt kind, "
    "float c) -> ()", _torch_minmax_update, cuda=_cuda_minmax_update, fake=_check_update)


def _check_record(lo, hi, seen) -> None:
    _check_ranges("record_non_finite", lo, hi)
    if seen.numel() != 1 or seen.dtype != torch.bool or seen.device != lo.device:
        raise ValueError(f"quantscope::record_non_finite: seen must be one bool on {lo.device}, "
                         f"got {seen.dtype} {tuple(seen.shape)} on {seen.device}")


def _torch_record_non_finite(lo, hi, seen) -> None:
    _check_record(lo, hi, seen)
    if lo.numel():  # no units: nothing to record (amin of nothing is an error)
        seen |= any_non_finite(extreme_ends(lo, hi))


def _cuda_record_non_finite(lo, hi, seen) -> None:
    kernel = _triton.launchers("minmax", lo, writes=(seen,))
    if kernel is None:
        return _torch_record_non_finite(lo, hi, seen)
    _check_record(lo, hi, seen)
    kernel.update_state(lo.contiguous(), hi.contiguous(), None, None, seen, 0, 0.0)
    return None


#: ``seen`` (one bool) set where per-unit ``lo`` / ``hi`` hold NaN or an infinity (the
#: observers' non-finite check: their smallest min or largest max is not finite), in place,
#: with no host read: one Triton launch on CUDA where the torch ops take seven.
record_non_finite = define(
    "record_non_finite(Tensor lo, Tensor hi, Tensor(a!) seen) -> ()", _torch_record_non_finite,
    cuda=_cuda_record_non_finite, fake=_check_record)


# ---- an accumulating min-max observer's whole step: one op ------------------------------------

def _check_observe(units, state_lo, state_hi, seen, tokens, kind, c, count) -> None:
    # (this check is the op's fake implementation too)
    who = "quantscope::minmax_observe"
    if units.dim() not in (2, 4) or units.dtype not in MINMAX_DTYPES \
            or math.prod(units.shape[units.dim() // 2:]) == 0:
        raise ValueError(f"{who}: units must be a [units, elements] or [U1, U2, E1, E2] tensor "
                         f"of float32, bfloat16 or float16 with elements (stats.minmax.op_units), "
                         f"got {units.dtype} {tuple(units.shape)}")
    n = op_unit_count(units)
    for name, t in (("state_lo", state_lo), ("state_hi", state_hi)):
        if t.shape != (n,) or t.dtype != torch.float32 or t.device != units.device \
                or not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be a contiguous float32 tensor of the {n} "
                             f"units on {units.device}, got {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}")
    _check_kind(who, kind, c)
    for name, t, dtype in (("seen", seen, torch.bool), ("tokens", tokens, torch.int64)):
        if t.numel() != 1 or t.dtype != dtype or t.device != units.device:
            raise ValueError(f"{who}: {name} must be one {dtype} on {units.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    # a SymInt count (traced from the input's shape) is a size, never negative; the real
    # call checks the int it becomes
    if isinstance(count, int) and count < 0:
        raise ValueError(f"{who}: count (tokens to add) must be >= 0, got {count}")


def _torch_minmax_observe(units, state_lo, state_hi, seen, tokens, kind, c, count) -> None:
    _check_observe(units, state_lo, state_hi, seen, tokens, kind, c, count)
    lo, hi = ops.unit_minmax(units)
    _torch_record_non_finite(lo, hi, seen)
    _torch_minmax_update(lo, hi, state_lo, state_hi, kind, c)
    tokens.add_(count)


def triton_minmax_observe(kernel, units, state_lo, state_hi, seen, tokens, kind, c, count) -> None:
    """:func:`minmax_observe` by the Triton launchers ``kernel``: one min / max pass, then one
    launch that joins its chunks' extremes, records the non-finite flag, updates the state
    and adds the token count."""
    lo, hi, splits = kernel.partial_minmax(units)
    kernel.update_state(lo, hi, state_lo, state_hi, seen, kind, c, splits, tokens, count)


def _cuda_minmax_observe(units, state_lo, state_hi, seen, tokens, kind, c, count) -> None:
    kernel = _triton.launchers("minmax", units, writes=(state_lo, state_hi, seen, tokens))
    if kernel is None:
        return _torch_minmax_observe(units, state_lo, state_hi, seen, tokens, kind, c, count)
    _check_observe(units, state_lo, state_hi, seen, tokens, kind, c, count)
    triton_minmax_observe(kernel, units, state_lo, state_hi, seen, tokens, kind, c, count)
    return None


#: An accumulating min-max observer's ``forward`` as one op, in place: the per-unit min / max
#: of ``units`` (an :func:`op_units` view), ``seen`` set where they hold NaN or an infinity
#: (:func:`record_non_finite`), the state updated (:func:`minmax_update`, ``kind`` an
#: :data:`UPDATES` code) and ``count`` tokens added to ``tokens``. The same arithmetic as
#: those ops one by one; one dispatch where they take three (on a GPU the host's time per
#: observer call is mostly dispatch).
minmax_observe = define(
    "minmax_observe(Tensor units, Tensor(a!) state_lo, Tensor(b!) state_hi, Tensor(c!) seen, "
    "Tensor(d!) tokens, SymInt kind, float c, SymInt count) -> ()", _torch_minmax_observe,
    cuda=_cuda_minmax_observe, fake=_check_observe)
