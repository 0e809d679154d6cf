"""Number formats: what values a quantized element can hold, and rounding onto them.

Two kinds cover every element type quantscope knows:

* :class:`IntFormat` -- integers of 2 to 16 bits, signed or unsigned, optionally
  narrow (``qmin = -qmax``).
* :class:`FloatFormat` -- small IEEE-like floats (fp8 e4m3fn / e5m2, fp6, fp4),
  with subnormals, saturating at the largest finite value.

Both round to the nearest representable value with ties to even (``torch.round``
is half-to-even) and saturate at the format's range keeping the sign. All
arithmetic is float32; the results are float32 tensors holding representable
values (quantization *codes* for integers, values for floats).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from ._plainchecks import as_bool

__all__ = [
    "FORMATS",
    "FP4_E2M1",
    "FP6_E2M3",
    "FP6_E3M2",
    "FP8_E4M3",
    "FP8_E5M2",
    "INT2",
    "INT3",
    "INT4",
    "INT8",
    "INT16",
    "UINT4",
    "UINT8",
    "FloatFormat",
    "Format",
    "IntFormat",
    "format_to_json",
    "get_format",
    "named",
]


# the Python values of numpy-or-Python scalars: formats, layouts and specs are below
# _checks (which imports spec), so they live here and _checks reuses them
def as_int(value) -> int | None:
    """``value`` as a Python int if it is an integer (numpy's too; not a bool, which would
    read as 0 / 1), else None. Constructors (formats, layouts, specs) keep the Python value:
    numpy's would leak into ``to_dict`` (JSON) and ``repr``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def as_number(value) -> int | float | None:
    """``value`` as a Python int or float if it is a real number (numpy's too; not a bool),
    else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return as_int(value) if isinstance(value, numbers.Integral) else float(value)


def tensor_arg(who: str, name: str, value, expected: str, **kwargs) -> torch.Tensor:
    """``torch.as_tensor(value, **kwargs)``, but ``TypeError`` naming ``who``, ``name`` and
    what was ``expected`` where torch cannot convert ``value`` (a str, None: its own message,
    ``new(): invalid data type 'str'``, names neither the call nor the argument). Here, not
    in _checks: layout's ``Group(g_idx=)`` uses it too."""
    if isinstance(value, np.ndarray):  # a reversed view: torch refuses negative strides
        value = np.ascontiguousarray(value)
    try:  # None fails with a RuntimeError, an int past int64 and float an OverflowError
        return torch.as_tensor(value, **kwargs)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise TypeError(f"{who}: {name} must be {expected}, got {type(value).__name__} "
                        f"{value!r:.80} ({e})") from None


@dataclass(frozen=True)
class IntFormat:
    """A ``bits``-wide integer; ``narrow`` drops the most negative code (``qmin = -qmax``)."""

    bits: int
    signed: bool = True
    narrow: bool = False

    def __post_init__(self):
        bits = as_int(self.bits)  # numpy's too, kept as the Python int
        if bits is None or not 2 <= bits <= 16:
            raise ValueError(f"IntFormat.bits must be an integer from 2 to 16, got {self.bits!r}")
        object.__setattr__(self, "bits", bits)
        for name in ("signed", "narrow"):  # None or "no" would pass here and break in str / to_dict
            flag = as_bool(getattr(self, name))
            if flag is None:
                raise ValueError(f"IntFormat.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
            object.__setattr__(self, name, flag)
        if self.narrow and not self.signed:
            raise ValueError("IntFormat.narrow applies to signed formats only (got signed=False)")

    is_float = False

    @property
    def qmin(self) -> int:
        """The smallest code: ``-2 ** (bits - 1)`` (one more if ``narrow``), 0 if unsigned."""
        if not self.signed:
            return 0
        return -(2 ** (self.bits - 1)) + (1 if self.narrow else 0)

    @property
    def qmax(self) -> int:
        """The largest code: ``2 ** (bits - 1) - 1``, or ``2 ** bits - 1`` if unsigned."""
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def max(self) -> float:
        """Largest magnitude on the positive side, in code units."""
        return float(self.qmax)

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two below ``max`` (MX / BFP shared-exponent rule)."""
        return self.bits - 2 if self.signed else self.bits - 1

    @property
    def mbits(self) -> int:
        """Fraction bits below the leading one at full scale (amax rounding in the MX 'even'
        mode)."""
        return self.emax

    @property
    def name(self) -> str:
        """``"int8"``, ``"uint4"``, ``"int8_narrow"`` ...: the name :func:`get_format` reads."""
        return f"{'' if self.signed else 'u'}int{self.bits}{'_narrow' if self.narrow else ''}"

    def round(self, x: torch.Tensor, qmin: float | None = None, qmax: float | None = None, *,
              inplace: bool = False):
        """Round half-to-even and clamp to ``[qmin, qmax]`` (the format's range by default).

        ``inplace=True`` overwrites ``x`` (a float32 tensor the caller owns) and returns it.
        """
        if x.dtype in (torch.float16, torch.bfloat16):  # else its clamp to 32767 gave 32768
            x = x.float()
        lo = self.qmin if qmin is None else qmin
        hi = self.qmax if qmax is None else qmax
        return (x.round_() if inplace else torch.round(x)).clamp_(lo, hi)


@dataclass(frozen=True)
class FloatFormat:
    """A small float with ``ebits`` exponent and ``mbits`` mantissa bits.

    ``max`` is the largest finite value (it encodes the format's NaN / inf
    convention: e4m3fn has no inf and gives up one mantissa code to NaN, so its
    max is 448 rather than 480). It must be one of the format's values, at most the top
    code ``2 ** (bias + 1) * (2 - 2 ** -mbits)``, else ``ValueError``. Below
    ``2 ** min_exp`` values are subnormal: spaced ``2 ** (min_exp - mbits)`` apart down to
    zero. :meth:`round` builds that step as a normal float32, so a format needs
    ``min_exp - mbits >= -126`` (ebits up to 7; 8 with mbits 0 only): a bfloat16-like e8m7
    raises ``ValueError``.
    """

    name: str
    ebits: int
    mbits: int
    max: float
    torch_dtype: torch.dtype | None = None

    is_float = True
    signed = True

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:  # it names the format in str / JSON
            raise ValueError(
                f"FloatFormat.name must be a non-empty string, got {self.name!r}")
        if self.torch_dtype is not None and not isinstance(self.torch_dtype, torch.dtype):
            raise ValueError(
                f"FloatFormat.torch_dtype must be a torch.dtype or None, got {self.torch_dtype!r}")
        for name in ("ebits", "mbits"):  # numpy's integers too, kept as Python ints
            v = as_int(getattr(self, name))
            if v is None:
                raise ValueError(f"FloatFormat.{name} must be an integer, got "
                                 f"{getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        if self.ebits < 1 or self.mbits < 0:
            raise ValueError(f"FloatFormat: need ebits >= 1 and mbits >= 0, got ebits="
                             f"{self.ebits}, mbits={self.mbits}")
        # round's step 2 ** (e - mbits) is built as a normal float32 (as in the C kernels)
        if self.min_exp - self.mbits < -126:
            raise ValueError(
                f"FloatFormat {self.name!r}: the smallest step 2 ** (min_exp - mbits) = "
                f"2 ** {self.min_exp - self.mbits} (ebits={self.ebits}, mbits={self.mbits}) "
                f"must be a normal float32 (at least 2 ** -126), as round and the C kernels "
                f"build it: use fewer ebits or mbits")
        # round clamps float32 values at max: it must be a finite float32 itself
        top = as_number(self.max)  # numpy's too, kept as the Python number
        if top is None or not 0 < top <= torch.finfo(torch.float32).max:
            raise ValueError(f"FloatFormat.max must be a positive finite number float32 holds "
                             f"(the largest finite value), got {self.max!r}")
        object.__setattr__(self, "max", top)
        self._check_max_on_grid()

    def _check_max_on_grid(self):
        """``max`` must be a value of the encoding, else round's clamp returns values (``max``
        itself, or past the top exponent) that no (ebits, mbits) code holds. A value below the
        top code stays allowed: reserved NaN / inf codes (e4m3fn 448 < 480, e5m2)."""
        fmt = f"e{self.ebits}m{self.mbits} (bias {self.bias})"
        # every code finite; float32's exponents end at 127 (e8m0's 2 ** 128 is no float32)
        top = 2.0 ** min(self.bias + 1, 127) * (2 - 2.0 ** -self.mbits)
        if self.max > top:
            raise ValueError(f"FloatFormat {self.name!r}: max={self.max!r} is past the largest "
                             f"finite value {fmt} can hold, {top!r}")
        # spacing 2 ** (e - mbits) at max's exponent e (min_exp for subnormals); exact
        step = 2.0 ** (max(math.frexp(self.max)[1] - 1, self.min_exp) - self.mbits)
        if not (self.max / step).is_integer():
            lo = math.floor(self.max / step) * step
            raise ValueError(f"FloatFormat {self.name!r}: max={self.max!r} is not a value of "
                             f"{fmt}: its neighbours are {lo!r} and {lo + step!r}; max must "
                             f"be one of its values, at most {top!r}")

    @property
    def bias(self) -> int:
        """The exponent bias, ``2 ** (ebits - 1) - 1`` (7 for e4m3, 1 for e2m1)."""
        return 2 ** (self.ebits - 1) - 1

    @property
    def min_exp(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two at most ``max``, ``floor(log2(max))`` (8 for e4m3,
        2 for e2m1): the MX shared-exponent rule's."""
        return math.floor(math.log2(self.max))

    @property
    def qmin(self) -> float:
        """``-max``: float formats are symmetric, their range is ``[-max, max]``."""
        return -self.max

    @property
    def qmax(self) -> float:
        """``max``, the largest finite value (what the scale formulas divide by)."""
        return self.max

    def round(self, x: torch.Tensor, qmin: float | None = None, qmax: float | None = None, *,
              inplace: bool = False):
        """Round float32 ``x`` to the nearest representable value, ties to even, saturating.

        From the format's definition, for any ebits / mbits: the spacing of representable
        values around ``x`` is ``2 ** (e - mbits)`` with ``e`` the exponent of ``x`` (at
        least ``min_exp``: subnormals). The step is the float32 exponent field of ``x``,
        masked in place; dividing and multiplying by it is exact, so the only rounding is
        ``torch.round`` (half to even), which is what the IEEE default does (with ``mbits`` 0
        every value's mantissa is even: a tie goes to the larger magnitude, as torch's
        ``float8_e8m0fnu`` cast rounds). Rounding up may
        carry into the next binade, which is representable; the clamp then saturates at
        ``max`` (inf included; NaN stays NaN). ``inplace=True`` overwrites ``x`` (a float32
        tensor the caller owns) and returns it.

        For fp8 this equals torch's float8 casts bit for bit (tests/core/test_formats.py, every
        bfloat16 and float16 input) and is on par with clamp + cast + cast back on CPU
        (measured interleaved: e4m3 up to 1.4x faster, e5m2 up to 1.4x slower), and it
        works in place, so one path serves every format.
        """
        x = x.float()
        # float32 exponent field, computed before x may be overwritten: 2 ** e; an inf's (255)
        # taken as the top binade's, so that its step is finite (mbits 0: 2 ** 127, not inf,
        # whose inf / inf is NaN) and inf saturates as every format's
        field = x.view(torch.int32) & 0x7F800000
        field.clamp_(min=(self.min_exp + 127) << 23, max=254 << 23).sub_(self.mbits << 23)
        step = field.view(torch.float32)  # 2 ** (e - mbits), a normal float32
        q = x.div_(step) if inplace else x / step
        q.round_().mul_(step)
        return q.clamp_(-self.max if qmin is None else qmin, self.max if qmax is None else qmax)


Format = IntFormat | FloatFormat

INT2 = IntFormat(2)
INT3 = IntFormat(3)
INT4 = IntFormat(4)
INT8 = IntFormat(8)
INT16 = IntFormat(16)
UINT4 = IntFormat(4, signed=False)
UINT8 = IntFormat(8, signed=False)

FP8_E4M3 = FloatFormat("fp8_e4m3", 4, 3, 448.0, torch.float8_e4m3fn)
FP8_E5M2 = FloatFormat("fp8_e5m2", 5, 2, 57344.0, torch.float8_e5m2)
FP6_E3M2 = FloatFormat("fp6_e3m2", 3, 2, 28.0)
FP6_E2M3 = FloatFormat("fp6_e2m3", 2, 3, 7.5)
FP4_E2M1 = FloatFormat("fp4_e2m1", 2, 1, 6.0)

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (INT2, INT3, INT4, INT8, INT16, UINT4, UINT8,
              FP8_E4M3, FP8_E5M2, FP6_E3M2, FP6_E2M3, FP4_E2M1)
}
_ALIASES = {"fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "e5m2": "fp8_e5m2",
            "fp4": "fp4_e2m1", "e2m1": "fp4_e2m1", "e3m2": "fp6_e3m2", "e2m3": "fp6_e2m3"}


def get_format(name: str | Format | dict) -> Format:
    """A format by name: ``int8``, ``uint4``, ``int5``, ``int8_narrow``, ``fp8_e4m3``, ``fp4`` ...,
    or a custom float format from the dict of its fields (what :func:`format_to_json` writes)."""
    if isinstance(name, (IntFormat, FloatFormat)):
        return name
    if isinstance(name, dict):
        return _float_format_from_dict(name)
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key in FORMATS:
        return FORMATS[key]
    base, narrow = (key[: -len("_narrow")], True) if key.endswith("_narrow") else (key, False)
    for prefix, signed in (("uint", False), ("int", True)):
        if base.startswith(prefix) and base[len(prefix):].isdigit():
            try:
                return IntFormat(int(base[len(prefix):]), signed=signed, narrow=narrow)
            except ValueError as e:
                raise ValueError(f"format {name!r}: {e}") from None
    raise ValueError(
        f"format: unknown name {name!r}; expected intN / uintN (N = 2..16, optional '_narrow') "
        f"or one of {sorted(k for k in FORMATS if k.startswith('fp'))}"
    )


_FLOAT_FIELDS = ("name", "ebits", "mbits", "max")


def named(fmt: Format) -> bool:
    """Whether ``fmt``'s name reads back as ``fmt`` (:func:`get_format`): every integer and
    built-in float format, not a custom float format (which may even bear a built-in one's
    name). What takes a format by name (the ops, a file) can take only these."""
    try:
        return get_format(fmt.name) == fmt
    except ValueError:  # a custom name
        return False


def format_to_json(fmt: Format) -> str | dict:
    """A JSON-able ``fmt`` that :func:`get_format` reads back as an equal format: its name
    where it is :func:`named`, else a custom float format's fields (its torch dtype by
    name)."""
    if named(fmt):
        return fmt.name
    dtype = None if fmt.torch_dtype is None else str(fmt.torch_dtype).removeprefix("torch.")
    return {**{k: getattr(fmt, k) for k in _FLOAT_FIELDS}, "torch_dtype": dtype}


def _float_format_from_dict(d: dict) -> FloatFormat:
    """The :class:`FloatFormat` of :func:`format_to_json`'s dict (validated by FloatFormat)."""
    if not set(_FLOAT_FIELDS) <= d.keys() <= {*_FLOAT_FIELDS, "torch_dtype"}:
        raise ValueError(f"format: a dict describes a FloatFormat by the fields "
                         f"{list(_FLOAT_FIELDS)} (and optionally torch_dtype), got keys "
                         f"{sorted(d)}")
    dtype = d.get("torch_dtype")
    if dtype is not None:
        dtype = getattr(torch, str(dtype), None) if isinstance(dtype, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"format: torch_dtype must be None or a torch dtype's name "
                             f"('float8_e4m3fn'), got {d['torch_dtype']!r}")
    return FloatFormat(**{**d, "torch_dtype": dtype})
