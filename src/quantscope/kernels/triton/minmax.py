"""Per-unit min and max of a ``[units, elements]`` view in one read (Triton); also of a
``[U1, U2, E1, E2]`` view, so every layout without padding (a channel axis in the middle,
tiles) reads the tensor in place.

Each program takes ``BLOCK_U`` units and one chunk of their elements, keeps elementwise
running extremes in registers and reduces them once at the end; where the units are too
few to fill the GPU (per-tensor, a few channels) the elements are split into chunks whose
partial extremes a small torch reduction joins. bf16 / fp16 / fp32 inputs are read as they
are and widened to float32 in registers (exact); results are float32. NaN propagates: a unit
with a NaN gets NaN for both, as ``torch.aminmax`` gives (an explicit flag: the GPU's
``min`` would drop it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._numerics import as_float32, upload
from ._jit import LAUNCH, cdiv, next_power_of_2, widen

__all__ = ["grouped_descriptors", "grouped_unit_minmax", "partial_minmax", "unit_minmax",
           "update_state"]

#: programs below which the elements are split into chunks (a few per SM of an H100)
TARGET_PROGRAMS = 512


@triton.jit
def _minmax_kernel(x_ptr, lo_ptr, hi_ptr, U, E, U2, E2, su1, su2, se1, se2, chunk, splits,
                   BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr, FOUR_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    split = tl.program_id(1)
    start = split.to(tl.int64) * chunk  # a unit may pass 2 ** 31 elements (a 405B lm_head)
    if FOUR_D:  # unit (u1, u2), element (e1, e2) of a [U1, U2, E1, E2] view
        r64 = rows.to(tl.int64)
        row_off = (r64 // U2) * su1 + (r64 % U2) * su2
    else:
        row_off = rows.to(tl.int64) * su1
    lo = tl.full([BLOCK_U, BLOCK_E], float("inf"), tl.float32)
    hi = tl.full([BLOCK_U, BLOCK_E], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_U, BLOCK_E], tl.int32)
    for e0 in range(0, chunk, BLOCK_E):
        within = e0 + tl.arange(0, BLOCK_E)
        cols = start + within
        mask = (rows[:, None] < U) & (cols[None, :] < E) & (within[None, :] < chunk)
        if FOUR_D:
            c64 = cols.to(tl.int64)
            col_off = (c64 // E2) * se1 + (c64 % E2) * se2
        else:
            col_off = cols.to(tl.int64) * se2
        x = tl.load(x_ptr + row_off[:, None] + col_off[None, :], mask=mask, other=0.0)
        x = widen(x)
        lo = tl.minimum(lo, tl.where(mask, x, float("inf")))
        hi = tl.maximum(hi, tl.where(mask, x, float("-inf")))
        nan = nan | (x != x).to(tl.int32)  # noqa: PLR0124 (the NaN test)
    has_nan = tl.max(nan, axis=1) > 0
    lo_u = tl.where(has_nan, float("nan"), tl.min(lo, axis=1))
    hi_u = tl.where(has_nan, float("nan"), tl.max(hi, axis=1))
    out = rows * splits + split
    tl.store(lo_ptr + out, lo_u, mask=rows < U)
    tl.store(hi_ptr + out, hi_u, mask=rows < U)


def _blocks(U: int, E: int, block_e: int | None, block_u: int | None) -> tuple[int, int]:
    be = block_e or min(next_power_of_2(E), 512)
    bu = block_u or max(1, min(next_power_of_2(U), 4096 // be))
    return bu, be


def _split(U: int, E: int, bu: int, be: int, splits: int | None) -> tuple[int, int]:
    """(chunk, splits): elements per program along a unit, and the number of chunks."""
    if splits is None:
        programs = cdiv(U, bu)
        splits = 1 if programs >= TARGET_PROGRAMS else min(
            cdiv(E, 4 * be), cdiv(TARGET_PROGRAMS, programs))
    splits = max(1, splits)
    chunk = cdiv(cdiv(E, splits), be) * be
    return chunk, cdiv(E, chunk)


def unit_minmax(units: torch.Tensor, *, block_u: int | None = None, block_e: int | None = None,
                splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``, float32 ``[U]``, of ``units``: a ``[U, E]`` view, or a ``[U1, U2, E1, E2]``
    view whose units are ``(u1, u2)`` and elements ``(e1, e2)`` (the layouts whose units are
    no row view: a channel axis in the middle, tiles; any strides; ``E >= 1``). The block sizes
    and the split count are chosen from the shape unless given (the tests force small ones
    to cover every loop)."""
    lo, hi, splits = partial_minmax(units, block_u=block_u, block_e=block_e, splits=splits)
    if splits == 1:
        return lo, hi
    U = lo.numel() // splits
    return lo.view(U, splits).amin(1), hi.view(U, splits).amax(1)  # amin / amax keep NaN


def partial_minmax(units: torch.Tensor, *, block_u: int | None = None,
                   block_e: int | None = None, splits: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`unit_minmax` before the join of its chunks: ``(lo, hi, splits)``, float32
    ``[U * splits]`` holding unit ``u``'s extremes over each of its ``splits`` chunks of
    elements from ``u * splits`` on (:func:`update_state` joins them in its own launch)."""
    if units.dim() == 2:
        (U, E), (U2, E2) = units.shape, (1, units.shape[1])
        (su1, se2), su2, se1 = units.stride(), 0, 0
    else:
        U1, U2, E1, E2 = units.shape
        U, E = U1 * U2, E1 * E2
        su1, su2, se1, se2 = units.stride()
    if U == 0:  # no program to launch (and none to split the elements among)
        lo = torch.empty(0, dtype=torch.float32, device=units.device)
        return lo, torch.empty_like(lo), 1
    bu, be = _blocks(U, E, block_e, block_u)
    chunk, splits = _split(U, E, bu, be, splits)
    lo = torch.empty(U * splits, dtype=torch.float32, device=units.device)
    hi = torch.empty_like(lo)
    grid = (cdiv(U, bu), splits)
    _minmax_kernel[grid](units, lo, hi, U, E, U2, E2, su1, su2, se1, se2, chunk, splits,
                         BLOCK_U=bu, BLOCK_E=be, FOUR_D=units.dim() == 4, **LAUNCH)
    return lo, hi, splits


#: int64 entries per program in a grouped launch's descriptors (see the kernel)
DESC_WIDTH = tl.constexpr(7)

#: the element type of a grouped launch's pointers, by torch dtype
_POINTEE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _grouped_minmax_kernel(desc_ptr, DTYPE: tl.constexpr, BLOCK_U: tl.constexpr,
                           BLOCK_E: tl.constexpr, VEC: tl.constexpr):
    # this program's descriptor: tensor address, first row, rows, elements, row stride, and
    # the addresses of its tensor's own lo / hi outputs
    d = desc_ptr + tl.program_id(0) * DESC_WIDTH
    base = tl.load(d).to(tl.pointer_type(DTYPE))
    row0, U, E = tl.load(d + 1), tl.load(d + 2), tl.load(d + 3)
    stride = tl.load(d + 4)
    if VEC > 1:  # what the launch checked: 16-byte loads, as a launch per tensor would make
        base = tl.multiple_of(base, 16)
        E = tl.multiple_of(E, VEC)
        stride = tl.multiple_of(stride, VEC)
    lo_ptr = tl.load(d + 5).to(tl.pointer_type(tl.float32))
    hi_ptr = tl.load(d + 6).to(tl.pointer_type(tl.float32))
    rows = row0 + tl.arange(0, BLOCK_U)
    lo = tl.full([BLOCK_U, BLOCK_E], float("inf"), tl.float32)
    hi = tl.full([BLOCK_U, BLOCK_E], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_U, BLOCK_E], tl.int32)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        mask = (rows[:, None] < U) & (cols[None, :] < E)
        x = tl.load(base + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)
        x = widen(x)
        lo = tl.minimum(lo, tl.where(mask, x, float("inf")))
        hi = tl.maximum(hi, tl.where(mask, x, float("-inf")))
        nan = nan | (x != x).to(tl.int32)  # noqa: PLR0124 (the NaN test)
    has_nan = tl.max(nan, axis=1) > 0
    tl.store(lo_ptr + rows, tl.where(has_nan, float("nan"), tl.min(lo, axis=1)), mask=rows < U)
    tl.store(hi_ptr + rows, tl.where(has_nan, float("nan"), tl.max(hi, axis=1)), mask=rows < U)


def grouped_descriptors(tensors: list[torch.Tensor], los: list[torch.Tensor],
                        his: list[torch.Tensor], block_u: int) -> torch.Tensor:
    """int64 ``[programs, DESC_WIDTH]`` on the host: per program of
    :func:`grouped_unit_minmax`, its tensor's address, first row, rows, elements, row stride
    and the addresses of the tensor's outputs ``los[i]`` / ``his[i]``; from shapes and
    addresses only (no device read). One row per tensor, repeated for its programs: a Python
    row per program took 10 ms of host time for a layer's seven weights."""
    per_tensor = torch.tensor([(t.data_ptr(), 0, t.shape[0], t.shape[1], t.stride(0),
                                lo.data_ptr(), hi.data_ptr())
                               for t, lo, hi in zip(tensors, los, his, strict=True)],
                              dtype=torch.int64).reshape(-1, DESC_WIDTH.value)
    programs = (per_tensor[:, 2] + block_u - 1) // block_u
    desc = per_tensor.repeat_interleave(programs, dim=0)
    first = torch.cumsum(programs, 0) - programs  # each tensor's first program
    desc[:, 1] = (torch.arange(len(desc)) - first.repeat_interleave(programs)) * block_u
    return desc


def _vector_width(tensors: list[torch.Tensor]) -> int:
    """Elements a 16-byte load holds where every tensor's address, row stride and row length
    allow one (the grouped kernel reads them from memory: only this hint vectorizes its
    loads, 4.5x on an H200); else 1."""
    vec = 16 // tensors[0].element_size()
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) % vec == 0 and t.shape[1] % vec == 0
                  for t in tensors)
    return vec if aligned else 1


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without a stream synchronization (``_numerics.upload``), pinned
    first on CUDA: from pageable memory even a non-blocking copy may wait (the CUDA runtime's
    rule); the caching host allocator keeps the pinned block until the copy is done."""
    if device.type == "cuda" and torch.cuda.is_available():
        host = host.pin_memory()
    return upload(host, device)


def grouped_unit_minmax(tensors: list[torch.Tensor], *, block_u: int | None = None,
                        block_e: int | None = None
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-row min / max of every ``[U_i, E_i]`` tensor (one dtype, rows contiguous, E_i >= 1)
    in ONE launch: two lists, float32 ``[U_i]`` per tensor, each tensor its own allocation."""
    device = tensors[0].device
    los = [torch.empty(t.shape[0], dtype=torch.float32, device=device) for t in tensors]
    his = [torch.empty_like(lo) for lo in los]
    if not sum(t.shape[0] for t in tensors):
        return los, his
    be = block_e or min(next_power_of_2(max(t.shape[1] for t in tensors)), 512)
    bu = block_u or max(1, 4096 // be)
    desc = _upload(grouped_descriptors(tensors, los, his, bu), device)
    _grouped_minmax_kernel[(desc.shape[0],)](desc, DTYPE=_POINTEE[tensors[0].dtype],
                                             BLOCK_U=bu, BLOCK_E=be,
                                             VEC=_vector_width(tensors), **LAUNCH)
    return los, his


# ---- an observer's state update, fused ------------------------------------------------------

#: the updates of ``stats.minmax.update_state`` (its ``UPDATES`` codes), and 0: none (the
#: non-finite flag alone)
NO_UPDATE, MIN, EMA, EMA_LERP = 0, 1, 2, 3


@triton.jit
def _update(s, b, c, one_minus_c, KIND: tl.constexpr, IS_LO: tl.constexpr):
    """State ``s`` after batch ``b``, each float32 step rounded as ``update_state``'s ops."""
    if KIND == 1:
        if IS_LO:
            return tl.minimum(s, b, propagate_nan=tl.PropagateNan.ALL)
        return tl.maximum(s, b, propagate_nan=tl.PropagateNan.ALL)
    if KIND == 2:  # s + c * (b - s)
        return s + (b - s) * c
    return s * one_minus_c + b * c  # KIND 3: s * (1 - c) + b * c


@triton.jit
def _joined(ptr, offs, mask, splits, IS_LO: tl.constexpr):
    """Each unit's extreme over its ``splits`` partial ones (``partial_minmax``), NaN kept."""
    x = tl.load(ptr + offs * splits, mask=mask, other=0.0)
    for s in range(1, splits):
        y = tl.load(ptr + offs * splits + s, mask=mask, other=0.0)
        if IS_LO:
            x = tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)
        else:
            x = tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)
    return x


@triton.jit(do_not_specialize=["count"])  # each batch's count: one compiled kernel
def _state_kernel(lo_ptr, hi_ptr, slo_ptr, shi_ptr, seen_ptr, tokens_ptr, count, n, splits, c,
                  one_minus_c, KIND: tl.constexpr, RECORD: tl.constexpr, COUNT: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    # the observer's token count, by the first program: no launch of its own
    if COUNT:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if tl.program_id(0) == 0:
            tl.store(tokens_ptr, tl.load(tokens_ptr) + count)
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    lo = _joined(lo_ptr, offs, mask, splits, True)
    hi = _joined(hi_ptr, offs, mask, splits, False)
    if RECORD:
        # |x| < inf is false for NaN and +-inf; masked lanes read 0
        finite = (tl.abs(lo) < float("inf")) & (tl.abs(hi) < float("inf"))
        bad = tl.max((~finite).to(tl.int32), axis=0)
        if bad > 0:  # every program that sees one stores the same True: no atomics needed
            tl.store(seen_ptr, bad.to(tl.int1))
    if KIND != 0:
        slo = tl.load(slo_ptr + offs, mask=mask, other=0.0)
        shi = tl.load(shi_ptr + offs, mask=mask, other=0.0)
        tl.store(slo_ptr + offs, _update(slo, lo, c, one_minus_c, KIND, True), mask=mask)
        tl.store(shi_ptr + offs, _update(shi, hi, c, one_minus_c, KIND, False), mask=mask)


def update_state(lo: torch.Tensor, hi: torch.Tensor, state_lo: torch.Tensor | None,
                 state_hi: torch.Tensor | None, seen: torch.Tensor | None, kind: int,
                 c: float, splits: int = 1, tokens: torch.Tensor | None = None,
                 count: int = 0) -> None:
    """In place, from per-unit ``lo`` / ``hi`` (contiguous float32 ``[n]``; or ``[n * splits]``,
    :func:`partial_minmax`'s chunks, joined here: no amin / amax ops between the launches):
    ``seen`` (one bool; None: not recorded) set where they hold NaN or an infinity, and the
    state ``state_lo`` / ``state_hi`` updated (``kind``: the codes above, NO_UPDATE with no
    state; ``c`` the moving average's constant: its float32, and that of ``1 - c``, as torch's
    ops on a float32 tensor take the Python scalars); ``count`` added to ``tokens`` (one
    int64; None: no count)."""
    n = lo.numel() // splits
    if not n or (seen is None and kind == NO_UPDATE):  # no launch: the count alone
        if tokens is not None:
            tokens.add_(count)
        return
    # rounded in Python: a float32 tensor per constant took six ops per observer call
    c32, one_minus_c32 = as_float32(c), as_float32(1.0 - c)
    _state_kernel[(cdiv(n, 1024),)](
        lo, hi, lo if state_lo is None else state_lo, hi if state_hi is None else state_hi,
        lo if seen is None else seen, lo if tokens is None else tokens, count, n, splits, c32,
        one_minus_c32, KIND=int(kind), RECORD=seen is not None, COUNT=tokens is not None,
        BLOCK_N=1024, **LAUNCH)
