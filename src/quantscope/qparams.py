"""Quantization parameters from a range: the one place every scale formula lives.

Given per-unit ``lo <= hi`` (any shape; results keep it), :func:`qparams_from_range`
returns the scale, zero point and (NVFP4) global scale of a :class:`QuantSpec`:

* The range is first widened to include zero, so zero is always exact.
* Symmetric: ``scale = amax / ((qmax - qmin) / 2)`` with ``amax = max(-lo, hi)``:
  int8 divides by 127.5 (by 127 with a narrow range), float formats by their max
  (448 for e4m3, 6 for e2m1). Zero point 0, or mid-range for unsigned formats
  (128 for uint8, as torch.ao's quint8).
* Asymmetric: ``scale = (hi - lo) / (qmax - qmin)``,
  ``zero_point = clamp(round(qmin - lo / scale), qmin, qmax)``, rounded half to even.
* The scale is then stored in its encoding (:mod:`~quantscope.scales`) and kept at
  least ``eps`` (NVFP4: a block scale that rounds to 0 becomes ``eps``, an e4m3 value; E8M0
  scales take none); the zero point is computed from the stored scale.
* MX (E8M0): ``2 ** k`` per the encoding's mode. NVFP4: a global scale from the
  tensor's amax and e4m3 block scales ``amax_block / format_max * global``; the
  scale that runs is ``block_scale / global_scale``.

Nothing here returns NaN or inf: an all-zero unit gets the smallest scale.

The C kernels that search ranges carry one copy of the integer branch with fp32 scales
(``quantscope/kernels/csrc/qs_qparams.h``); tests/kernels/test_native.py holds it bitwise to this
one.

Against the peers (tests/core/test_peers_core.py): compressed-tensors' ``calculate_qparams``
gives bitwise the same scales and zero points (int, fp8, fp6, fp4, NVFP4, its MX = our
``e8m0:even``), except that it *replaces* a zero scale by eps where we clamp every scale
below eps (so a tiny but non-zero range differs) and gives zero point 0 (a NaN cast) for an
all-zero asymmetric range. torch.ao's ``_calculate_qparams``: bitwise the same scales;
its zero point ``qmin - round(lo / scale)`` equals ours except where ``lo / scale`` is a
tie with odd ``qmin``, or within float32 rounding of a tie. Symmetric unsigned ranges
narrower than the format take the upper midpoint here, torch.ao the lower one.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import kernels
from ._checks import (
    check_e8m0_args,
    check_int_consts,
    check_nvfp4_args,
    check_range_args,
    check_ranges,
    is_amax,
)
from ._numerics import true_div, upload
from ._oplib import define
from .formats import FP8_E4M3, FloatFormat, get_format, named
from .kernels import triton as _triton
from .scales import (
    E8M0_MODES,
    ScaleEncoding,
    e8m0_scale,
    encode_scale,
    nvfp4_global_scale,
    smallest_scale_at_least,
)
from .spec import QuantSpec

__all__ = ["QParams", "amax_of_range", "nvfp4_block_scales", "qparams_from_range"]


def amax_of_range(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of the range ``[lo, hi]`` (``max(-lo, hi)``, elementwise): what
    symmetric and block formats scale. The one place the formula is written (the C kernel
    in ``kernels/csrc/qs_qparams.h`` mirrors it)."""
    return torch.maximum(-lo, hi)


@dataclass(eq=False)  # tensors have no truth value: ``==`` is identity (as Calibration's)
class QParams:
    """Scale, zero point and optional global scale, shaped per the spec's layout.

    ``scale`` is float32 (for NVFP4 it holds the e4m3 block scales); ``zero_point``
    is int32; ``global_scale`` is a float32 tensor of shape ``(1,)`` or None.
    The scale that multiplies a code is :attr:`effective_scale`. Tensors given in a
    float8 dtype, as compressed-tensors stores NVFP4 block scales and fp8 zero points,
    are read as float32 (every value exact): torch does no arithmetic in float8.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    global_scale: torch.Tensor | None = None

    def __post_init__(self):
        for name in ("scale", "zero_point", "global_scale"):
            t = getattr(self, name)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() == 1:
                setattr(self, name, t.float())

    @property
    def effective_scale(self) -> torch.Tensor:
        """The scale a code is multiplied by: ``scale``, or ``scale / global_scale`` (NVFP4)."""
        if self.global_scale is None:
            return self.scale
        return self.scale / self.global_scale

    def to(self, *args, **kwargs) -> QParams:
        """A copy with each tensor's ``.to(*args, **kwargs)`` (a dtype casts all three)."""
        gs = None if self.global_scale is None else self.global_scale.to(*args, **kwargs)
        return QParams(self.scale.to(*args, **kwargs), self.zero_point.to(*args, **kwargs), gs)

    def reshape(self, *shape) -> QParams:
        """A copy with ``scale`` and ``zero_point`` reshaped to ``shape``; ``global_scale`` kept."""
        return QParams(self.scale.reshape(*shape), self.zero_point.reshape(*shape),
                       self.global_scale)

    def __iter__(self):  # ``scale, zero_point = qparams`` as the references return them
        return iter((self.scale, self.zero_point))


#: units from which the block branches (MX, NVFP4) run in C (kernels/csrc/block_qparams.c)
#: in an unchecked call (an observer's forward: they read a flag back); a checked call reads
#: back anyway and runs them at any count (the integer branch has no threshold)
KERNEL_MIN_UNITS = 1 << 14


def _affine_consts(spec: QuantSpec) -> list[float] | None:
    """The integer branch's constants (:func:`kernels.qparams_consts`) for ``spec``'s qparams,
    float formats with fp32 scales included where their max is a whole number (fp8, fp6
    e3m2, fp4: ``_affine_qparams``' symmetric formula, zero point 0); None elsewhere."""
    fmt = spec.format
    if isinstance(fmt, FloatFormat) and spec.scale.kind == "fp32" and float(
            fmt.max).is_integer() and fmt.max < 2**31:  # (the ops' codes: whole int32 numbers)
        return [float(spec.qmin), float(spec.qmax), float(spec.min_scale), 1.0, 0.0]
    return kernels.qparams_consts(spec)


_consts: dict[int, tuple] = {}


def _int_consts(spec: QuantSpec):
    """:func:`_affine_consts` of ``spec`` as the C array the integer kernel reads (None where
    it does not apply), made once per spec object (at most 64 kept): no tensor per call."""
    hit = _consts.get(id(spec))
    if hit is None or hit[0] is not spec:
        consts = _affine_consts(spec)
        if len(_consts) >= 64:
            _consts.clear()
        array = None if consts is None else (ctypes.c_double * 5)(*consts)
        hit = _consts[id(spec)] = (spec, array)
    return hit[1]


def _new(shape, dtype: torch.dtype, fill=torch.empty) -> torch.Tensor:
    """``fill(shape, dtype=dtype)`` on the CPU: a kernel's output (sizes as ints: torch parses
    them in half the time of a ``torch.Size``)."""
    return fill(*shape, dtype=dtype) if len(shape) else fill((), dtype=dtype)


def _kernel_took(result: int, ordered: bool) -> bool:
    """Whether a qparams kernel's ``result`` (``qs_range_flags``, csrc/qs_qparams.h) stands:
    not for NaN / inf (1), nor for ``lo > hi`` (2) where the caller needs ``ordered``."""
    return result == 0 or (result == 2 and not ordered)


def _int_qparams_kernel(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec,
                        ordered: bool = False, shape=None) -> QParams | None:
    """The integer branch with fp32 scales in one C pass over float32 CPU ranges, its results
    made in ``shape`` (``lo``'s by default; as many values); None where it does not apply (no
    kernel, other formats or devices, a NaN / inf range, with ``ordered`` one with ``lo >
    hi``: the torch branch then raises or computes). Bitwise the torch branch
    (tests/kernels/test_native.py)."""
    if (lo.device.type != "cpu" or lo.requires_grad or hi.requires_grad
            or not kernels.real(lo, hi) or (lib := kernels.lib("int_qparams")) is None
            or (consts := _int_consts(spec)) is None):  # (after the context: no trace)
        return None
    lo, hi = lo.contiguous(), hi.contiguous()
    shape = lo.shape if shape is None else shape
    scale, zp = _new(shape, torch.float32), _new(shape, torch.int32)
    if not _kernel_took(lib.qs_int_qparams(lo.data_ptr(), hi.data_ptr(), lo.numel(), consts,
                                           scale.data_ptr(), zp.data_ptr()), ordered):
        return None
    return QParams(scale, zp)


def _block_kernel_applies(spec: QuantSpec) -> bool:
    """Whether the block kernels compute ``spec``'s qparams: E8M0 scales over float or
    integer elements (MX, MXINT8, BFP16: the kernels take the format's emax, mbits and max),
    fp8 block scales over float elements (NVFP4)."""
    kind = spec.scale.kind
    return kind == "e8m0" or (kind == "fp8_e4m3" and isinstance(spec.format, FloatFormat))


def _block_qparams_kernel(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec,
                          global_amax, ordered: bool = False, shape=None) -> QParams | None:
    """The E8M0 (MX) and fp8-block (NVFP4) branches in C over float32 CPU ranges (results in
    ``shape``, as :func:`_int_qparams_kernel`'s); None where it does not apply (no kernel,
    other encodings or devices, a NaN / inf range, with ``ordered`` one with ``lo > hi``: the
    torch branch then raises or computes). Bitwise the torch branch
    (tests/kernels/test_block_qparams.py)."""
    enc, fmt = spec.scale, spec.format
    if (not _block_kernel_applies(spec) or lo.device.type != "cpu" or lo.requires_grad
            or hi.requires_grad or not kernels.real(lo, hi)
            or (lib := kernels.lib("block_qparams")) is None):
        return None
    lo, hi = lo.contiguous(), hi.contiguous()
    shape = lo.shape if shape is None else shape
    scale, zero = _new(shape, torch.float32), _new(shape, torch.int32, torch.zeros)
    if enc.kind == "e8m0":
        mode = E8M0_MODES.index(enc.mode)
        if not _kernel_took(lib.qs_e8m0_qparams(lo.data_ptr(), hi.data_ptr(), lo.numel(), mode,
                                                fmt.emax, fmt.mbits, fmt.max, scale.data_ptr()),
                            ordered):
            return None
        return QParams(scale, zero)
    if global_amax is None:
        amax = torch.empty((), dtype=torch.float32)
        if lib.qs_block_amax_max(lo.data_ptr(), hi.data_ptr(), lo.numel(), amax.data_ptr()):
            return None
        global_amax = amax
    elif not is_amax(global_amax):
        return None  # the torch branch says what is wrong
    gs = nvfp4_global_scale(torch.as_tensor(global_amax, dtype=torch.float32), fmt).reshape(1)
    if gs.numel() != 1 or not _kernel_took(lib.qs_nvfp4_qparams(
            lo.data_ptr(), hi.data_ptr(), lo.numel(), fmt.max, float(gs), spec.min_scale,
            scale.data_ptr()), ordered):
        return None
    return QParams(scale, zero, gs)


def _int_qparams_op(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> QParams | None:
    """The integer branch with fp32 scales as the op ``quantscope::int_qparams`` (below: one
    launch on CUDA, Triton); None where it does not apply."""
    consts = _affine_consts(spec)
    if consts is None or lo.requires_grad or hi.requires_grad or lo.numel() == 0:
        return None
    scale, zp = int_qparams_op(lo.float(), hi.float(), consts)
    return QParams(scale, zp)


def _block_qparams_op(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec,
                      global_amax) -> QParams | None:
    """The E8M0 (MX) and fp8-block (NVFP4) branches as the ops ``quantscope::e8m0_block_scales``
    / ``nvfp4_qparams`` (below: Triton on CUDA, one launch; NVFP4 two, or three with the
    global amax to find); None where they do not apply. Bitwise the torch branch
    (tests/core/test_qparams_ops.py)."""
    enc, fmt = spec.scale, spec.format
    if (not _block_kernel_applies(spec) or not named(fmt)  # the ops take the format by name
            or lo.requires_grad or hi.requires_grad or lo.numel() == 0):
        return None
    lo, hi = lo.float(), hi.float()
    zero = torch.zeros(lo.shape, dtype=torch.int32, device=lo.device)
    if enc.kind == "e8m0":
        return QParams(e8m0_block_scales_op(lo, hi, fmt.name, enc.mode), zero)
    if global_amax is not None:
        global_amax = upload(global_amax, lo.device, torch.float32).reshape(1)
    block, gs = nvfp4_qparams_op(lo, hi, global_amax, fmt.name, spec.min_scale)
    return QParams(block, zero, gs)


def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, *,
                       global_amax: torch.Tensor | None = None,
                       check_finite: bool = True, shape=None) -> QParams:
    """Scale and zero point for per-unit ranges ``[lo, hi]`` under ``spec``, of ``lo``'s
    shape, or ``shape`` (a reshape of them: the C kernels make them in it, no view after).

    ``global_amax`` is NVFP4's whole-tensor absolute maximum (other specs ignore it); by
    default the largest ``max(|lo|, |hi|)`` over the units given (all blocks of one tensor).

    A NaN / inf range, or ``lo > hi``, raises ``ValueError``. That check reads a flag back;
    code on a hot path whose ranges come from data already checked upstream (a search in an
    observer's forward, which records non-finite input itself; run-time dynamic
    quantization) passes ``check_finite=False``, which also skips the refusals of float64
    values past float32's range (they would turn inf below) and of meta tensors.
    """
    # check_finite reads values back: not on meta (check_finite=False: shapes only)
    check_range_args("qparams_from_range", spec, lo, hi, global_amax, check_finite)
    lo = torch.as_tensor(lo, dtype=torch.float32)
    hi = torch.as_tensor(hi, dtype=torch.float32, device=lo.device)
    if lo.shape != hi.shape:
        raise ValueError(f"qparams_from_range: lo and hi must have one shape, got "
                         f"{tuple(lo.shape)} and {tuple(hi.shape)}")
    # the integer branch in C for any CPU ranges: one call costs less than the torch
    # branch's dozen small ops at every count (one unit: 12 against 44-55 us)
    made = shape if shape is not None and math.prod(shape) == lo.numel() else None
    qp = _int_qparams_kernel(lo, hi, spec, check_finite, made) if lo.numel() else None
    if qp is None and (check_finite or lo.numel() >= KERNEL_MIN_UNITS):
        qp = _block_qparams_kernel(lo, hi, spec, global_amax, check_finite, made)
    if check_finite:  # after the C kernels, which test NaN / inf and lo > hi in their pass
        check_ranges("qparams_from_range", lo, hi, global_amax, ranges=qp is None)
    if qp is None:
        qp = _unkernelled(lo, hi, spec, global_amax)
    return qp if shape is None or qp.scale.shape == shape else qp.reshape(shape)


def _unkernelled(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec, global_amax) -> QParams:
    """:func:`qparams_from_range` where no C kernel took the ranges: the ops off the CPU,
    else the torch branches."""
    if lo.device.type != "cpu":  # the ops (Triton on CUDA) where they apply
        qp = _block_qparams_op(lo, hi, spec, global_amax)
        if qp is None:
            qp = _int_qparams_op(lo, hi, spec)
        if qp is not None:
            return qp
    lo = lo.clamp(max=0)
    hi = hi.clamp(min=0)
    if spec.scale.is_block:
        return _block_qparams(amax_of_range(lo, hi), spec, global_amax)
    return _scale_qparams(lo, hi, spec)


def _block_qparams(amax: torch.Tensor, spec: QuantSpec, global_amax) -> QParams:
    """The block encodings' branch from the units' ``amax``: E8M0 ``2 ** k`` (MX), or e4m3
    block scales under a global scale (NVFP4; the global amax defaults to the largest)."""
    fmt, enc = spec.format, spec.scale
    zero = torch.zeros(amax.shape, dtype=torch.int32, device=amax.device)
    if enc.kind == "e8m0":
        return QParams(e8m0_scale(amax, fmt, enc.mode), zero)
    block, gs = _nvfp4_scales(amax, global_amax, fmt, spec.min_scale, enc)
    return QParams(block, zero, gs.to(amax.device))


def _nvfp4_scales(amax: torch.Tensor, global_amax, fmt, min_scale: float,
                  encoding: ScaleEncoding | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's block scales and global scale (``[1]``) from the blocks' ``amax``; the global
    amax defaults to the largest."""
    if global_amax is None:
        global_amax = amax.max() if amax.numel() else amax.new_zeros(())
    gs = nvfp4_global_scale(torch.as_tensor(global_amax, dtype=torch.float32), fmt).reshape(1)
    # the 0-d global scale: the block scales keep amax's shape (0-d included, as the kernels')
    return nvfp4_block_scales(amax, gs.reshape(()), fmt, min_scale, encoding or FP8_BLOCK), gs


#: NVFP4's block scale encoding; the integer formats' default one
FP8_BLOCK = ScaleEncoding("fp8_e4m3")
FP32_SCALE = ScaleEncoding("fp32")


def nvfp4_block_scales(amax: torch.Tensor, global_scale: torch.Tensor, fmt, min_scale: float,
                       encoding: ScaleEncoding = FP8_BLOCK) -> torch.Tensor:
    """NVFP4's block scales ``encode(amax / fmt.max * global_scale)``, ``min_scale`` where that
    is not positive (the one place of the formula; kernels/triton/block_qparams.py and
    csrc/block_qparams.c mirror it, and tests hold them to it bitwise)."""
    block = encode_scale(true_div(amax, fmt.max) * global_scale, encoding)
    return torch.where(block > 0, block, torch.full_like(block, min_scale))


def _scale_qparams(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> QParams:
    """One scale per unit (fp32, fp16, bf16, pow2 encodings) from a range that holds zero."""
    fmt = spec.format
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    zsym = 0 if fmt.signed else int(qmin + qmax + 1) // 2
    return _affine_qparams(lo, hi, qmin, qmax, spec.min_scale, spec.symmetric, zsym,
                           spec.scale)


def _affine_qparams(lo, hi, qmin: float, qmax: float, min_scale: float, symmetric: bool,
                    zsym: int, enc: ScaleEncoding) -> QParams:
    """The integer formula (the one place of it; csrc/qs_qparams.h and the Triton
    ``int_qparams`` mirror it, bitwise): symmetric ``amax / ((qmax - qmin) / 2)`` and the
    zero point ``zsym``, else ``(hi - lo) / (qmax - qmin)`` with the zero point
    ``round(qmin - lo / scale)`` from the stored scale; ``lo <= 0 <= hi``."""
    if symmetric:
        scale = true_div(amax_of_range(lo, hi), (qmax - qmin) / 2)
    else:
        scale = true_div(hi - lo, qmax - qmin)
        # hi - lo overflows float32 only for ranges near its max: divide first there
        scale = torch.where(scale < math.inf, scale,
                            true_div(hi, qmax - qmin) - true_div(lo, qmax - qmin))
    scale = encode_scale(scale.clamp(min=smallest_scale_at_least(min_scale, enc)), enc)
    if symmetric:
        return QParams(scale, torch.full(lo.shape, zsym, dtype=torch.int32, device=lo.device))
    zp = torch.round(qmin - lo / scale).clamp_(qmin, qmax)
    return QParams(scale, zp.to(torch.int32))


# ---- the qparams as ops ----------------------------------------------------------------------
# ``quantscope::int_qparams`` / ``e8m0_block_scales`` / ``nvfp4_qparams`` (kernels.ops lists
# them with the other ops): the formulas above from per-unit ranges, one Triton launch each
# on CUDA (``nvfp4_qparams`` a second one where it finds the global amax). They live here
# because qparams_from_range calls them off the CPU, and kernels.ops builds on this module;
# their argument checks (the fakes' too) are _checks' (check_int_consts ...).

def _torch_e8m0_block_scales(lo: Tensor, hi: Tensor, format: str, mode: str) -> Tensor:
    check_e8m0_args(lo, hi, format, mode)
    # contiguous like the Triton kernel's and the fake's outputs, whatever lo's strides
    lo, hi = lo.contiguous(), hi.contiguous()
    return e8m0_scale(amax_of_range(lo.clamp(max=0), hi.clamp(min=0)), get_format(format), mode)


def _cuda_e8m0_block_scales(lo, hi, format, mode):
    kernel = _triton.launchers("block_qparams", lo)
    if kernel is None:
        return _torch_e8m0_block_scales(lo, hi, format, mode)
    check_e8m0_args(lo, hi, format, mode)
    fmt = get_format(format)
    return kernel.e8m0_block_scales(lo.contiguous(), hi.contiguous(), E8M0_MODES.index(mode),
                                    fmt.emax, fmt.mbits, fmt.max)


def _fake_e8m0_block_scales(lo, hi, format, mode):
    check_e8m0_args(lo, hi, format, mode)
    return lo.new_empty(lo.shape)


e8m0_block_scales_op = define(
    "e8m0_block_scales(Tensor lo, Tensor hi, str format, str mode) -> Tensor",
    _torch_e8m0_block_scales, cuda=_cuda_e8m0_block_scales, fake=_fake_e8m0_block_scales)


def _torch_int_qparams(lo: Tensor, hi: Tensor, consts: list[float]) -> tuple[Tensor, Tensor]:
    check_int_consts(lo, hi, consts)
    qmin, qmax, min_scale, symmetric, zsym = consts
    lo, hi = lo.contiguous(), hi.contiguous()  # contiguous outputs, as the kernel's and fake's
    qp = _affine_qparams(lo.clamp(max=0), hi.clamp(min=0), qmin, qmax, min_scale,
                         bool(symmetric), int(zsym), FP32_SCALE)
    return qp.scale, qp.zero_point


def _cuda_int_qparams(lo, hi, consts):
    kernel = _triton.launchers("block_qparams", lo)
    if kernel is None:
        return _torch_int_qparams(lo, hi, consts)
    check_int_consts(lo, hi, consts)
    return kernel.int_qparams(lo.contiguous(), hi.contiguous(), *consts)


def _fake_int_qparams(lo, hi, consts):
    check_int_consts(lo, hi, consts)
    return lo.new_empty(lo.shape), lo.new_empty(lo.shape, dtype=torch.int32)


#: ``(scale, zero_point)`` of an integer format with fp32 scales from per-unit ranges
#: (``consts``: :func:`quantscope.kernels.qparams_consts`), as ``qparams_from_range``'s
#: integer branch gives them; float32 / int32 of ``lo``'s shape.
int_qparams_op = define(
    "int_qparams(Tensor lo, Tensor hi, float[] consts) -> (Tensor, Tensor)",
    _torch_int_qparams, cuda=_cuda_int_qparams, fake=_fake_int_qparams)


def _torch_nvfp4_qparams(lo: Tensor, hi: Tensor, global_amax: Tensor | None, format: str,
                         min_scale: float) -> tuple[Tensor, Tensor]:
    fmt = check_nvfp4_args(lo, hi, global_amax, format, min_scale)
    lo, hi = lo.contiguous(), hi.contiguous()  # contiguous outputs, as the kernel's and fake's
    return _nvfp4_scales(amax_of_range(lo.clamp(max=0), hi.clamp(min=0)), global_amax, fmt,
                         min_scale)


def _cuda_nvfp4_qparams(lo, hi, global_amax, format, min_scale):
    kernel = _triton.launchers("block_qparams", lo)
    if kernel is None:
        return _torch_nvfp4_qparams(lo, hi, global_amax, format, min_scale)
    fmt = check_nvfp4_args(lo, hi, global_amax, format, min_scale)
    lo, hi = lo.contiguous(), hi.contiguous()
    amax = kernel.global_amax(lo, hi) if global_amax is None else global_amax.reshape(1)
    return kernel.nvfp4_qparams(lo, hi, amax, fmt.max, FP8_E4M3.max, FP8_E4M3.min_exp,
                                FP8_E4M3.mbits, min_scale)


def _fake_nvfp4_qparams(lo, hi, global_amax, format, min_scale):
    check_nvfp4_args(lo, hi, global_amax, format, min_scale)
    return lo.new_empty(lo.shape), lo.new_empty(1)


#: NVFP4's block scales and global scale (``[1]``) from per-block ranges, the global scale
#: from ``global_amax`` (one float32 value), or None: the ranges' largest absolute value; as
#: ``qparams_from_range``'s NVFP4 branch gives them, with no host read.
nvfp4_qparams_op = define(
    "nvfp4_qparams(Tensor lo, Tensor hi, Tensor? global_amax, str format, float min_scale) "
    "-> (Tensor, Tensor)",
    _torch_nvfp4_qparams, cuda=_cuda_nvfp4_qparams, fake=_fake_nvfp4_qparams)
