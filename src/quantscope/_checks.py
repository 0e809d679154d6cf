"""Argument checks shared by constructors and estimator entry points: one message format.

Every option that sizes a loop or an allocation, or indexes into a kernel, enters through
one of these, so a bad value is a ``ValueError`` naming the argument (never a segfault in
C, a hang or a silently different result).
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping

import torch

from ._numerics import _F32_MAX
from ._plainchecks import check_bool, check_path
from .formats import FloatFormat, as_int, as_number, get_format, tensor_arg
from .scales import E8M0_MODES
from .spec import QuantSpec

__all__ = [
    "FrozenDict",
    "as_int",
    "as_number",
    "check_bool",
    "check_code",
    "check_code_range",
    "check_e8m0_args",
    "check_float32_range",
    "check_global_amax",
    "check_int",
    "check_int_consts",
    "check_not_meta",
    "check_number",
    "check_nvfp4_args",
    "check_nvfp4_min_scale",
    "check_op_global_amax",
    "check_op_ranges",
    "check_path",
    "check_per_unit",
    "check_range_args",
    "check_ranges",
    "check_real",
    "check_spec",
    "dtensor_error",
    "env_flag",
    "is_amax",
    "is_dtensor",
    "is_finite",
    "op_float_format",
    "outside_quantscope",
    "pattern_refusal",
    "regex_problem",
    "tensor_arg",
]


class FrozenDict(Mapping):
    """A read-only dict that hashes: a frozen dataclass's mapping field (its generated
    ``__hash__`` hashes every field). Equal to a dict of the same items."""

    def __init__(self, items=()):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):  # of the items as a set: equal mappings in any order hash alike
        return hash(frozenset(self._items.items()))

    def __repr__(self):
        return repr(self._items)


def env_flag(name: str, default: bool) -> bool:
    """An on / off environment variable: unset or empty gives ``default``; ``0``, ``false``,
    ``no``, ``off`` (any case) False; any other value True (``QUANTSCOPE_NO_KERNEL=false``
    turned the kernels off)."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ("0", "false", "no", "off")


def check_spec(who: str, spec) -> None:
    """``TypeError`` unless ``spec`` is a :class:`~quantscope.QuantSpec` (a format name such
    as ``"int8"`` is not: ``QuantSpec("int8")`` is)."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{who}: spec must be a QuantSpec, got {type(spec).__name__}")


def check_real(who: str, **values) -> None:
    """``TypeError`` on a complex tensor among ``values`` (by name): torch's casts to float32
    drop the imaginary part with only a warning, so the real part alone would run."""
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.is_complex():
            raise TypeError(f"{who}: {name} must be a real tensor, got {value.dtype}")


def check_int(who: str, name: str, value, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]``: a Python or numpy integer (``bool`` is not an
    integer here)."""
    n = as_int(value)
    if n is None or n < lo or (hi is not None and n > hi):
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{who}: {name} must be an integer {want}, got {value!r}")
    return n


def is_finite(n) -> bool:
    """``math.isfinite`` of a real number, False for an int beyond float's range (where
    ``math.isfinite`` raises ``OverflowError``, naming no argument)."""
    try:
        return math.isfinite(n)
    except OverflowError:
        return False


def check_number(who: str, name: str, value, lo: float, hi: float = math.inf, *,
                 lo_open: bool = False) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``): a Python
    or numpy real number (not a bool)."""
    n = as_number(value)
    ok = n is not None and is_finite(n)
    if ok:
        v = float(n)
        ok = (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        left, right = "(" if lo_open else "[", ")" if hi == math.inf else "]"
        raise ValueError(f"{who}: {name} must be a finite number in {left}{lo}, {hi}{right}, "
                         f"got {value!r}")
    return v


def check_code(who: str, name: str, value, lo: float, hi: float) -> float:
    """An integer code taken as a float by an op's schema: a whole number in ``[lo, hi]``
    (a fractional one would make codes that are not integers)."""
    v = check_number(who, name, value, lo, hi)
    if not v.is_integer():
        raise ValueError(f"{who}: {name} must be an integer code (a whole number), got {value!r}")
    return v


def check_code_range(who: str, qmin, qmax,
                     limit: float = float(torch.finfo(torch.float32).max)) -> None:
    """An integer format's code range ``qmin < qmax``, whole numbers in ``[-limit, limit]``
    (float32's range by default: past it a code is inf on the Triton path; int32's where the
    op returns int32 zero points)."""
    check_code(who, "qmin", qmin, -limit, limit)
    check_code(who, "qmax", qmax, -limit, limit)
    if not qmin < qmax:
        raise ValueError(f"{who}: qmin must be below qmax, got {qmin} and {qmax}")


def check_per_unit(who: str, name: str, t: torch.Tensor, units: int, device) -> None:
    """``t``: one float32 value per unit, shape ``(units,)``, on ``device``."""
    if t.shape != (units,) or t.dtype != torch.float32 or t.device != device:
        raise ValueError(f"{who}: {name} must be a float32 tensor of shape ({units},) on "
                         f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def check_not_meta(who: str, then: str, *tensors) -> None:
    """``ValueError`` if one of ``tensors`` is on the meta device, where a check must read
    values back; ``then``: the way out (the call's option that skips the check)."""
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        raise ValueError(f"{who}: got a tensor on the meta device; meta tensors hold no data, "
                         f"so the values cannot be checked ({then})")


def check_global_amax(who: str, global_amax) -> None:
    """A global amax: None, or one real value (a number, or a tensor of one value)."""
    if global_amax is None:
        return
    try:
        g = torch.as_tensor(global_amax)
    except (TypeError, ValueError, RuntimeError):
        g = None
    if g is None or g.dtype == torch.bool or g.is_complex():
        raise TypeError(f"{who}: global_amax must be a real number or tensor, got "
                        f"{type(global_amax).__name__} {global_amax!r}")
    if g.numel() != 1:
        raise ValueError(f"{who}: global_amax must be one value (the whole tensor's absolute "
                         f"maximum), got shape {tuple(g.shape)}")


def check_range_args(who: str, spec, lo, hi, global_amax, values: bool) -> None:
    """A range's arguments (:func:`~quantscope.qparams_from_range`'s): the spec, real ``lo`` /
    ``hi``, one real global amax (or None); with ``values`` (the checked mode, which hot paths
    skip) no meta tensor (its values are read back) and float64 within float32's range."""
    check_spec(who, spec)
    check_bool(who, "check_finite", values)  # 0 / None would turn the check off silently
    for name, value in (("lo", lo), ("hi", hi)):  # a tensor converts (the hot paths pass one)
        if not isinstance(value, torch.Tensor):
            tensor_arg(who, name, value, "a tensor or a real number", dtype=torch.float32)
    check_real(who, lo=lo, hi=hi)
    check_global_amax(who, global_amax)
    if values:
        check_not_meta(who, "pass check_finite=False", lo, hi, global_amax)
        check_float32_range(who, *(t for t in (lo, hi) if isinstance(t, torch.Tensor)))


def check_ranges(who: str, lo: torch.Tensor, hi: torch.Tensor, global_amax,
                 ranges: bool = True) -> None:
    """Raise ``ValueError`` on a NaN / inf range, on ``lo > hi``, or on a NaN / inf global
    amax (one read back each). ``ranges=False``: the ranges are known good (a C kernel
    tested them in its own pass), only the global amax is checked."""
    if ranges and not (lo.numel() and _spans_ok(lo, hi)):  # (the common case: three ops)
        # |x| < inf is isfinite in two ops (torch.isfinite takes four); NaN fails
        isfinite = (torch.stack((lo, hi)).abs() < math.inf).all()
        ordered, isfinite = torch.stack(((lo <= hi).all(), isfinite)).tolist()  # one read
        if not isfinite:
            raise ValueError(f"{who}: lo and hi must be finite (got NaN or inf)")
        if not ordered:
            raise ValueError(f"{who}: lo must be <= hi in every unit")
    if global_amax is not None and not is_amax(global_amax):
        raise ValueError(f"{who}: global_amax must be finite and >= 0 (an "
                         f"absolute maximum), got {global_amax!r}")


def _spans_ok(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether every ``hi - lo`` is finite and ``+0`` or more (one read): then both ends are
    finite and ordered (NaN fails, an infinite end gives an infinite or NaN span). A ``-0``
    span goes to the full checks: ``lo > hi`` a subnormal apart gives one where denormals
    flush to zero (``torch.set_flush_denormal``), as does the range ``[+0, -0]``."""
    low, high = torch.stack(torch.aminmax(hi - lo)).tolist()
    return (low > 0 or (low == 0 and math.copysign(1.0, low) > 0)) and high < math.inf


def is_amax(global_amax) -> bool:
    """Whether ``global_amax`` is finite and not negative (NaN compares false)."""
    # a number checked in float64: in the default dtype (float16) a large one would be inf
    g = global_amax if isinstance(global_amax, torch.Tensor) else torch.as_tensor(
        global_amax, dtype=torch.float64)
    return bool(((g >= 0) & (g < math.inf)).all())


def version_of(t: torch.Tensor | None) -> int | None:
    """``t``'s in-place version counter; None for None and for a tensor made under
    ``torch.inference_mode()``, which keeps none."""
    return None if t is None or t.is_inference() else t._version


def write_refused(t: torch.Tensor) -> bool:
    """Whether torch refuses an in-place write of ``t`` here: a tensor made under
    ``torch.inference_mode()``, written outside it (a kernel writing through ``data_ptr()``
    would not be refused: its caller asks first)."""
    return t.is_inference() and not torch.is_inference_mode_enabled()


def check_float32_range(who: str, *values: torch.Tensor) -> None:
    """Refuse finite float64 values float32 cannot hold: statistics and qparams are float32,
    where they would turn inf (and read as NaN / inf input). One check, and host read, per
    float64 tensor; none for other dtypes."""
    for value in values:
        if value.dtype != torch.float64:
            continue
        # the range in one pass without temporaries: the common case ends here (NaN, inf or a
        # value past float32's range take the exact check below)
        if value.numel() == 0:
            continue
        top = torch.finfo(torch.float32).max
        lo, hi = torch.aminmax(value)
        if bool((lo >= -top) & (hi <= top)):
            continue
        big = value.abs() > torch.finfo(torch.float32).max
        if bool((big & value.isfinite()).any()):
            raise ValueError(
                f"{who}: float64 values beyond float32's range (|x| > 3.4e38) are not "
                f"supported (quantscope computes statistics and qparams in float32), got "
                f"max |x| = {value[value.isfinite()].abs().max().item():.3g}")


def outside_quantscope() -> int:
    """The ``stacklevel`` of the first caller outside the quantscope package (whichever entry
    point it called), so that a warning names the user's line and Python's default filters
    show it in ``__main__``."""
    root = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(root)
                                 or frame.f_code.co_filename.endswith(_DECORATORS)):
        frame, level = frame.f_back, level + 1
    return level


#: torch's wrapper of a function decorated with ``torch.no_grad()`` / ``inference_mode()``:
#: a frame between quantscope's own, not the user's line
_DECORATORS = (os.path.join("torch", "utils", "_contextlib.py"),)


def is_dtensor(x) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 / tensor-parallel
    weight). Runs per forward, so a plain tensor (an activation) costs one type test;
    never imports the DTensor module (none can exist before it is imported)."""
    if type(x) is torch.Tensor:
        return False
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(x, cls)


def dtensor_error(who: str, x) -> TypeError:
    """What an observer named ``who`` raises for a DTensor ``x``: its ops see one rank's
    shard, so the statistics would be that shard's, or fail deep inside with no name."""
    return TypeError(f"{who}: got a DTensor (placements {tuple(x.placements)}), which holds "
                     f"this rank's shard of a distributed tensor; pass x.full_tensor() to "
                     f"observe the whole tensor (on every rank) or x.to_local() to observe "
                     f"this rank's part knowingly")


#: a ``re:`` target of a file someone else wrote: at most this long, and at most this many
#: repeats (``*``, ``+``, ``{m,n}``): k of them in a row cost ~len(name)**k steps on a name
#: they fail on (7 ``.*``: 5 s for one 67-character module name)
PATTERN_MAX, PATTERN_REPEATS = 512, 3


def _sre():
    """``re``'s own parser and its constants (``re._parser`` since 3.11, ``sre_parse``
    before)."""
    try:
        from re import _constants, _parser
    except ImportError:  # Python 3.10
        import sre_constants as _constants
        import sre_parse as _parser
    return _constants, _parser


def _regex_nodes(tree):
    """Every ``(op, argument)`` node of a parsed regular expression, nested ones included."""
    c, _ = _sre()
    for op, av in tree:
        yield op, av
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
            subs = [av[2]]
        elif op in (c.SUBPATTERN, c.ASSERT, c.ASSERT_NOT):
            subs = [av[-1]]
        elif op is c.BRANCH:
            subs = av[1]
        elif op is c.GROUPREF_EXISTS:
            subs = [s for s in av[1:] if s is not None]
        elif op is getattr(c, "ATOMIC_GROUP", None):
            subs = [av]
        else:
            subs = []
        for sub in subs:
            yield from _regex_nodes(sub)


def pattern_refusal(target) -> str | None:
    """Why a ``re:`` target / ignore entry of an untrusted file is refused
    (:func:`regex_problem`), as a message's tail naming it; None for one that may run."""
    if not (isinstance(target, str) and target.startswith("re:")):
        return None
    named = f"{target[:80]!r}{' ...' if len(target) > 80 else ''}"
    why = regex_problem(target[3:])
    if why is not None:
        return f"{named} {why}; such a pattern can take hours to match a module name"
    try:  # (the matcher's re.error names neither the file nor the field)
        re.compile(target[3:])
    except (re.error, RecursionError, OverflowError) as e:
        return f"{named} is not a regular expression ({e})"
    return None


def regex_problem(pattern: str) -> str | None:
    """Why the regular expression ``pattern`` (a ``re:`` target, without ``re:``) of an
    untrusted file could make ``re.match`` run for hours, or None. Python's ``re`` has no
    time limit: a repeat holding another repeat or alternatives (``(a+)+``, ``(.|.)*``)
    backtracks exponentially on a name it fails on, many repeats in a row polynomially. A
    pattern that does not compile is None here (the matcher's own error names it)."""
    c, parser = _sre()
    if len(pattern) > PATTERN_MAX:
        return f"is {len(pattern)} characters long (at most {PATTERN_MAX})"
    repeat_ops = {c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)}
    try:
        nodes = list(_regex_nodes(parser.parse(pattern)))
        repeats = [av for op, av in nodes if op in repeat_ops and av[1] > 1]
        nested = next((av for av in repeats if any(
            op in repeat_ops or op is c.BRANCH for op, _ in _regex_nodes(av[2]))), None)
    except (re.error, OverflowError):
        return None
    except RecursionError:
        return "nests its groups too deeply"
    if nested is not None:
        return ("repeats a part that itself holds a repeat or alternatives (nested "
                "quantifiers: exponential backtracking)")
    if len(repeats) > PATTERN_REPEATS:
        return f"has {len(repeats)} repeats (at most {PATTERN_REPEATS})"
    return None

# ---- the qparams ops' arguments (quantscope::int_qparams, e8m0_block_scales, nvfp4_qparams,
# and the block ops of kernels/block_ops.py): checked with no device read, in the fakes too

def check_op_ranges(lo: torch.Tensor, hi: torch.Tensor, who: str) -> None:
    """``ValueError`` unless ``lo`` / ``hi`` are float32 of one shape on one device."""
    if lo.dtype != torch.float32 or hi.dtype != torch.float32 or lo.shape != hi.shape \
            or lo.device != hi.device:
        raise ValueError(f"quantscope::{who}: lo and hi must be float32 tensors of one shape "
                         f"on one device, got {lo.dtype} {tuple(lo.shape)} on {lo.device} and "
                         f"{hi.dtype} {tuple(hi.shape)} on {hi.device}")


def check_e8m0_args(lo: torch.Tensor, hi: torch.Tensor, format: str, mode: str) -> None:
    """``quantscope::e8m0_block_scales``' arguments."""
    check_op_ranges(lo, hi, "e8m0_block_scales")
    get_format(format)  # a bad name raises here, on every device and in the fake
    if mode not in E8M0_MODES:
        raise ValueError(f"quantscope::e8m0_block_scales: mode must be one of {E8M0_MODES}, "
                         f"got {mode!r}")


def check_int_consts(lo: torch.Tensor, hi: torch.Tensor, consts: list[float]) -> None:
    """``quantscope::int_qparams``' arguments (``consts``: ``kernels.qparams_consts``')."""
    check_op_ranges(lo, hi, "int_qparams")
    if len(consts) != 5 or not consts[0] < consts[1] or consts[3] not in (0.0, 1.0):
        raise ValueError(f"quantscope::int_qparams: consts must be kernels.qparams_consts' "
                         f"[qmin, qmax, min_scale, symmetric, zero point], got {consts}")
    qmin, qmax, min_scale, _, zsym = consts
    who = "quantscope::int_qparams"  # (Python floats: checked with no device read)
    i32 = float(2**31 - 1)  # the zero points are int32
    check_code(who, "consts[0] (qmin)", qmin, -i32, i32)
    check_code(who, "consts[1] (qmax)", qmax, -i32, i32)
    # QuantSpec.eps's rule: positive and float32 (0 would divide the zero point by 0)
    check_number(who, "consts[2] (min_scale)", min_scale, 0.0, _F32_MAX, lo_open=True)
    check_code(who, "consts[4] (the symmetric zero point)", zsym, qmin, qmax)


def check_nvfp4_args(lo: torch.Tensor, hi: torch.Tensor, global_amax: torch.Tensor | None,
                     format: str, min_scale: float) -> FloatFormat:
    """The element format of NVFP4 ranges ``lo`` / ``hi`` under ``global_amax`` (one float32
    value, or None), or the ``ValueError`` naming what is wrong."""
    who = "nvfp4_qparams"
    check_op_ranges(lo, hi, who)
    if global_amax is not None:  # (its value unchecked: that would be a device read)
        check_op_global_amax(global_amax, lo.device, who, "None or ")
    check_nvfp4_min_scale(who, min_scale)
    return op_float_format(format, who)


def check_nvfp4_min_scale(who: str, min_scale: float) -> None:
    """An NVFP4 op's ``min_scale``: a float32 number; 0 too (a block scale that rounds to 0
    then stays 0: the block searches' NaN tests price such blocks,
    tests/kernels/test_triton_block_search.py)."""
    check_number(f"quantscope::{who}", "min_scale", min_scale, 0.0, _F32_MAX)


def check_op_global_amax(global_amax: torch.Tensor, device, who: str,
                         alternative: str = "") -> None:
    """``ValueError`` unless ``global_amax`` is one float32 value on ``device`` (the NVFP4
    ops' argument; ``alternative`` names what else the op accepts)."""
    if global_amax.numel() != 1 or global_amax.device != device \
            or global_amax.dtype != torch.float32:
        raise ValueError(f"quantscope::{who}: global_amax must be {alternative}one float32 "
                         f"value on {device}, got {global_amax.dtype} "
                         f"{tuple(global_amax.shape)} on {global_amax.device}")


def op_float_format(format: str, who: str) -> FloatFormat:
    """The float element format named ``format``, or the ``ValueError`` naming it."""
    fmt = get_format(format)
    if not isinstance(fmt, FloatFormat):
        raise ValueError(f"quantscope::{who}: format must be a float format, got "  # noqa: TRY004
                         f"{format!r}")
    return fmt
