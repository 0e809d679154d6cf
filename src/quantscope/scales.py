"""Scale encodings: the number format a scale itself is stored in.

A raw scale is a float32 ``amax / format_max``. Hardware and checkpoints store
it in a narrower form, and the quantizer that runs uses that stored value, so
qparams are computed through the encoding, never around it:

=============  ==============================================================
``fp32``       as computed (the default)
``fp16``       rounded to float16 / bfloat16 (nearest, ties to even)
``bf16``
``pow2``       ``2 ** round|floor|ceil(log2 s)`` (Quark's power-of-two scales;
               ``round`` is exact: up iff the mantissa is at least sqrt 2)
``e8m0``       MX shared exponent ``2 ** k``, ``k`` in [-127, 127], from the
               block amax by one of four modes (below)
``fp8_e4m3``   NVFP4 block scale: e4m3 under a per-tensor fp32 global scale
=============  ==============================================================

E8M0 modes, with ``emax`` the element format's largest exponent
(``floor(log2(format_max))``: 8 for e4m3, 2 for e2m1, 6 for int8 codes):

* ``floor`` (OCP MX v1.0; torchao ``FLOOR``, Quark ``floor``):
  ``k = floor(log2 amax) - emax``; values above the element max saturate.
* ``ceil`` (torchao ``CEIL``, Quark ``ceil``): ``k = ceil(log2 amax) - emax``; never
  saturates, may waste a bit.
* ``even`` (torchao ``EVEN``, Quark's default ``even``, microxcaling): round ``amax`` to the
  element's mantissa width, half up, first, then ``floor``: the exponent moves up exactly
  when the largest element would round past the binade. For int8 codes this is BFP16's
  overflow check. compressed-tensors' MX scales are this rule with the fp4 mantissa
  (1 bit) for MXFP4 and MXFP8 and E2M3's for MXFP6 (0.20): ours but for MXFP8.
* ``rceil`` (cuBLAS / NVIDIA, torchao ``RCEIL``; Quark has no such mode, whatever
  REFERENCES.md says): ``k = ceil(log2(amax / format_max))``, the smallest power of two that
  keeps every element unclipped. Computed exactly, from the exponents and mantissas of
  ``amax`` and ``format_max`` (no rounded quotient); torchao's eager path takes a float32
  ``amax / max`` and its ``log2``, and lands one binade low when the quotient lies within a
  rounding above a power of two, or is a float32 subnormal that rounds down onto ``2 ** -127``
  (the scale byte 0x00 where ours is 0x01).

All four are tested against their definitions and bitwise against torchao's ``to_mx``
(tests/core/test_scales.py, tests/core/test_peers_core.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._numerics import as_float32
from .formats import FP8_E4M3, FloatFormat, Format, IntFormat, get_format

__all__ = [
    "E8M0_EXPONENTS",
    "E8M0_MODES",
    "POW2_MODES",
    "SCALE_KINDS",
    "ScaleEncoding",
    "e8m0_scale",
    "encode_scale",
    "not_encoded",
    "nvfp4_global_scale",
    "smallest_scale_at_least",
]

SCALE_KINDS = ("fp32", "fp16", "bf16", "pow2", "e8m0", "fp8_e4m3")
POW2_MODES = ("round", "floor", "ceil")
E8M0_MODES = ("floor", "ceil", "even", "rceil")
#: the exponents ``k`` of the scales ``2 ** k`` an E8M0 byte stores (255 is NaN)
E8M0_EXPONENTS = (-127, 127)
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ScaleEncoding:
    """How scales are stored: ``kind`` from :data:`SCALE_KINDS`, ``mode`` for pow2 / e8m0."""

    kind: str = "fp32"
    mode: str | None = None

    def __post_init__(self):
        if self.kind not in SCALE_KINDS:
            raise ValueError(f"scale: unknown kind {self.kind!r}; expected one of {SCALE_KINDS}")
        allowed = {"pow2": POW2_MODES, "e8m0": E8M0_MODES}.get(self.kind, (None,))
        mode = self.mode if self.mode is not None else allowed[0]
        if mode not in allowed:
            raise ValueError(
                f"scale: mode {self.mode!r} is not valid for kind {self.kind!r}; expected one of "
                f"{allowed}")
        object.__setattr__(self, "mode", mode)

    @property
    def is_block(self) -> bool:
        """E8M0 and fp8 block scales belong to block formats (MX, NVFP4, BFP)."""
        return self.kind in ("e8m0", "fp8_e4m3")

    @property
    def has_global_scale(self) -> bool:
        """Whether scales sit under a per-tensor fp32 global scale (fp8 block scales: NVFP4)."""
        return self.kind == "fp8_e4m3"

    @property
    def default_eps(self) -> float:
        """Smallest scale allowed: float32's eps, or fp8's for fp8 block scales."""
        if self.kind == "fp8_e4m3":
            return float(torch.finfo(torch.float8_e4m3fn).eps)
        return float(torch.finfo(torch.float32).eps)

    def __str__(self) -> str:
        return self.kind if self.mode is None else f"{self.kind}:{self.mode}"

    @classmethod
    def parse(cls, value: str | ScaleEncoding) -> ScaleEncoding:
        """``"fp32"``, ``"pow2:floor"``, ``"e8m0:rceil"`` or an encoding."""
        if isinstance(value, ScaleEncoding):
            return value
        kind, _, mode = str(value).lower().partition(":")
        return cls(kind, mode or None)


def _parsed(who: str, name: str, value, parse, want: str, *kinds: type):
    """``value`` (a str, or one of ``kinds``) as ``parse`` reads it: QuantSpec's reading of its
    fields' names; ``TypeError`` naming the argument for anything else (None)."""
    if not isinstance(value, (str, *kinds)):
        raise TypeError(f"{who}: {name} must be {want}, got {type(value).__name__}")
    return parse(value)


def _exp2(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2 ** k`` for integer-valued ``k`` (float32 result)."""
    return torch.ldexp(torch.ones_like(k, dtype=torch.float32), k.to(torch.int32))


def _frexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.frexp`` of positive float32 ``x``, with inf read as ``2 ** 128`` (its exponent
    field's value: mantissa 0.5, exponent 129), as torchao and the kernels read it, so the
    scales of an inf amax saturate high; ``torch.frexp(inf)`` is ``(inf, 0)``."""
    mantissa, e = torch.frexp(x)
    inf = x == math.inf
    return torch.where(inf, 0.5, mantissa), torch.where(inf, 129, e)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2 x)`` for positive float32 x (via the exponent field; inf: 128)."""
    return _frexp(x)[1] - 1


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    mantissa, e = _frexp(x)
    return torch.where(mantissa == 0.5, e - 1, e)


_SQRT2_F32 = 1.41421353816986083984375  # float32(sqrt 2) < sqrt 2 < its float32 successor


def encode_scale(scale: torch.Tensor, encoding: ScaleEncoding | str) -> torch.Tensor:
    """Round positive float32 scales to what ``encoding`` stores (fp32 / fp16 / bf16 / pow2 / fp8).

    Positive finite scales stay positive and finite: fp16 / bf16 / pow2 saturate
    at their largest value and stop at their smallest positive one instead of
    overflowing to inf or flushing to 0; an inf scale takes the largest value, a NaN one
    stays NaN (every encoding alike). E8M0 needs the block amax and the
    element format: use :func:`e8m0_scale`. ``encoding``: a :class:`ScaleEncoding` or its
    name, read as :class:`~quantscope.QuantSpec` reads it (``"fp16"``, ``"pow2:floor"``).
    """
    if not isinstance(encoding, ScaleEncoding):
        encoding = _parsed("encode_scale", "encoding", encoding, ScaleEncoding.parse,
                           "a ScaleEncoding or its name ('fp16', 'pow2:floor')")
    kind = encoding.kind
    if kind in _DTYPES:
        info = torch.finfo(_DTYPES[kind])
        tiny = info.smallest_normal * info.eps  # smallest subnormal
        return scale.float().clamp(tiny, info.max).to(_DTYPES[kind]).float()
    if kind == "pow2":
        scale = scale.float()
        if encoding.mode == "round":
            # exact round(log2 s): up iff the mantissa is >= sqrt 2 (float32 log2 is not exact)
            m, e = _frexp(scale)
            k = torch.where(m * 2 > _SQRT2_F32, e, e - 1)
        elif encoding.mode == "floor":
            k = _floor_log2(scale)
        else:
            k = _ceil_log2(scale)
        # a NaN scale stays NaN, as the other encodings keep it (frexp gives it exponent 0)
        return torch.where(scale.isnan(), scale, _exp2(k.clamp_(-149, 127)))
    if kind == "fp8_e4m3":
        return FP8_E4M3.round(scale)
    raise ValueError(f"scale: encode_scale does not take {kind!r}; E8M0 scales come from "
                     f"e8m0_scale")


def not_encoded(scale: torch.Tensor, encoding: ScaleEncoding) -> torch.Tensor:
    """Where ``scale`` holds a value ``encoding`` cannot store (a bool tensor): not a power of
    two for pow2, not one in ``2 ** E8M0_EXPONENTS`` for E8M0 (2**-149 would wrap its byte),
    not an fp16 / bf16 value for those, not an e4m3 value in (0, 448] for fp8 block scales
    (every one the formula gives is, ``min_scale`` included: QuantSpec holds eps to e4m3).
    fp32 holds any."""
    if encoding.kind == "fp32":
        return torch.zeros(scale.shape, dtype=torch.bool, device=scale.device)
    if encoding.kind == "e8m0":
        return _exp2(_floor_log2(scale).clamp_(*E8M0_EXPONENTS)) != scale
    if encoding.kind == "fp8_e4m3":  # it rounds 0 and negative values to themselves
        return (encode_scale(scale, encoding) != scale) | (scale <= 0)
    exact = ScaleEncoding("pow2", "floor") if encoding.kind == "pow2" else encoding
    return encode_scale(scale, exact) != scale  # (these clamp to their smallest positive)


def smallest_scale_at_least(eps: float, encoding: ScaleEncoding) -> float:
    """The smallest scale ``encoding`` stores that is at least ``eps`` (in float32): the
    clamp before :func:`encode_scale` that keeps an encoded scale at least ``eps`` (clamping
    at ``eps`` itself, its encoding may round below it: bf16 0.001 -> 0.000999; encoding is
    monotonic, so values above an encoded bound encode at or above it). float32 scales: in
    Python (no tensor op where torch.compile traces the qparams)."""
    if encoding.kind == "fp32":
        return as_float32(eps)
    floor = torch.tensor([eps], dtype=torch.float32)
    got = encode_scale(floor, encoding)
    if got >= floor:
        return float(got)
    if encoding.kind == "pow2":
        return float(got) * 2
    # the next value up of the stored dtype: positive floats order as their bit patterns
    dtype, bits = {"fp16": (torch.float16, torch.int16), "bf16": (torch.bfloat16, torch.int16),
                   "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8)}[encoding.kind]
    return float(got.to(dtype).view(bits).add(1).view(dtype).float())


def _floor_log2_rounded(x: torch.Tensor, mbits: int) -> torch.Tensor:
    """``floor(log2(x rounded to mbits fraction bits, half away from zero))`` for positive x.

    microxcaling's / Quark's / torchao's 'even' rule: the exponent moves up exactly when
    the mantissa rounds to 2. Computed on the mantissa, so amax near float32's max
    cannot overflow to inf.
    """
    mantissa, e = _frexp(x)  # x = mantissa * 2**e, mantissa in [0.5, 1)
    carry = torch.floor(torch.ldexp(mantissa, torch.tensor(mbits + 1)) + 0.5) >= 2 ** (mbits + 1)
    return e - 1 + carry.to(e.dtype)


def e8m0_scale(amax: torch.Tensor, fmt: Format | str, mode: str = "floor") -> torch.Tensor:
    """The E8M0 shared scale ``2 ** k`` of blocks with absolute maximum ``amax``.

    An all-zero block (``amax == 0``) gets the smallest scale, ``2 ** -127``; an inf amax
    is read as ``2 ** 128`` (the scale saturates high) and a NaN one gets a NaN scale
    (E8M0's NaN, 0xFF), as torchao's ``to_mx``. ``fmt``: the element format or its name, read
    as :class:`~quantscope.QuantSpec` reads it (``"fp4_e2m1"``).
    """
    if not isinstance(fmt, (IntFormat, FloatFormat)):
        fmt = _parsed("e8m0_scale", "fmt", fmt, get_format,
                      "a format (IntFormat / FloatFormat) or its name ('fp4_e2m1')", dict)
    amax = amax.float()
    tiny = amax <= 0
    safe = torch.where(tiny, torch.ones_like(amax), amax)
    if mode == "floor":
        k = _floor_log2(safe) - fmt.emax
    elif mode == "ceil":
        k = _ceil_log2(safe) - fmt.emax
    elif mode == "even":
        k = _floor_log2_rounded(safe, fmt.mbits) - fmt.emax
    elif mode == "rceil":
        # no quotient to round (a float32 amax / max rounds onto 2 ** -127 where subnormal):
        # amax / max = (ma / mf) * 2 ** (ea - ef) with ma / mf in (0.5, 2), so the ceil of its
        # log2 is ea - ef, plus 1 where ma > mf; an inf amax gets the largest scale, as torchao
        mf, ef = math.frexp(as_float32(fmt.max))
        ma, ea = _frexp(safe)
        k = torch.where(safe < math.inf, ea - ef + (ma > mf).to(ea.dtype), 127)
    else:
        raise ValueError(f"scale: unknown e8m0 mode {mode!r}; expected one of {E8M0_MODES}")
    k = torch.where(tiny, torch.full_like(k, E8M0_EXPONENTS[0]), k).clamp_(*E8M0_EXPONENTS)
    return torch.where(amax.isnan(), math.nan, _exp2(k))


def nvfp4_global_scale(amax: torch.Tensor, fmt: Format, block_format: FloatFormat = FP8_E4M3):
    """NVFP4's fp32 global scale ``block_max * format_max / amax`` (1 where amax is 0 or NaN;
    an amax above float32's max counts as that max).

    It is also 1 where that quotient overflows float32: an amax below ``block_max *
    format_max`` over float32's max (NVFP4: ``448 * 6 / 3.4e38``, about ``7.9e-36``). The
    tensor's values, all below that amax, then quantize to 0, as compressed-tensors'
    ``generate_gparam`` (which vLLM reads) does.

    It maps the tensor's absolute maximum onto the largest block scale times the
    largest element, so block scales ``amax_block / format_max * global`` fill
    the fp8 range.
    """
    # an amax past float32's max (inf, or a search's candidate that overflowed) saturates
    # there: a global scale of 0 would make every effective scale inf
    amax = amax.float().clamp(max=torch.finfo(torch.float32).max)
    gs = (block_format.max * fmt.max) / amax
    return torch.where(torch.isfinite(gs) & (amax > 0), gs, torch.ones_like(gs))
