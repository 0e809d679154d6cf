"""QuantSpec: everything that defines a quantizer, validated once, at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ._numerics import _F32_MAX, as_float32
from ._plainchecks import as_bool
from .formats import FloatFormat, Format, IntFormat, as_int, as_number, format_to_json, get_format
from .layout import Block, Layout, parse_layout
from .scales import ScaleEncoding, encode_scale

__all__ = ["QuantSpec"]


def _is_e4m3(v: float) -> bool:
    """Whether ``v`` is a positive finite fp8 e4m3 value (what an NVFP4 block scale holds)."""
    t = torch.tensor(float(v), dtype=torch.float32)
    return 0 < float(v) <= 448 and bool(t.to(torch.float8_e4m3fn).float() == t)


@dataclass(frozen=True)
class QuantSpec:
    """A quantization scheme: element format, layout, symmetry and scale encoding.

    Args:
        format: an :class:`~quantscope.formats.IntFormat` / :class:`FloatFormat`, its
            name (``"int8"``, ``"uint4"``, ``"fp8_e4m3"``, ``"fp4"``...) or, for a custom
            float format, the dict of its fields that ``to_dict`` writes.
        layout: a :mod:`~quantscope.layout` object or its name (``"channel"``, ``"group:128"``).
        symmetric: zero point fixed at 0 (mid-range for unsigned formats) if True;
            otherwise an integer zero point from the range. Float formats are symmetric.
        scale: how scales are stored (``"fp32"``, ``"pow2:round"``, ``"e8m0:floor"``,
            ``"fp8_e4m3"`` for NVFP4); see :mod:`~quantscope.scales`.
        eps: the smallest scale: every fp32 / fp16 / bf16 / pow2 scale is at least ``eps``
            (default float32's eps; one above the encoding's largest scale is refused).
            With fp8 block scales (NVFP4) it is the block scale of a block whose scale
            rounds to 0, so an e4m3 value (default 0.125, fp8's eps, as compressed-tensors);
            E8M0 scales (MX) take none (an all-zero block gets 2**-127).
        quant_min, quant_max: a narrower integer code range than the format's
            (torch.ao's ``reduce_range`` or custom ranges); it must include 0 (the zero
            point is a code), and block scales (E8M0) take no narrower one: their exponent
            is sized for the format's full range.
    """

    format: Format | str = "int8"
    layout: Layout | str = "tensor"
    symmetric: bool = True
    scale: ScaleEncoding | str = "fp32"
    eps: float | None = None
    quant_min: int | None = None
    quant_max: int | None = None

    def __post_init__(self):
        fmt = get_format(self.format)
        layout = parse_layout(self.layout)
        scale = ScaleEncoding.parse(self.scale)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "scale", scale)
        symmetric = as_bool(self.symmetric)  # numpy's too, kept as the Python bool (to_dict)
        if symmetric is None:
            raise ValueError(f"QuantSpec.symmetric must be True or False, got {self.symmetric!r}")
        object.__setattr__(self, "symmetric", symmetric)
        if isinstance(fmt, FloatFormat) and not self.symmetric:
            raise ValueError(
                f"QuantSpec.symmetric: {fmt.name} is a float format and is symmetric only; "
                f"use symmetric=True or an integer format")
        if scale.is_block and not isinstance(layout, Block):
            raise ValueError(
                f"QuantSpec.layout: scale {scale} is a block scale (MX / NVFP4 / BFP) and needs a "
                f"Block layout, got {layout}")
        if scale.is_block and not fmt.signed:
            raise ValueError(
                f"QuantSpec.format: block scale {scale} needs a signed element format "
                f"(codes symmetric around 0), got {fmt.name}")
        if scale.is_block and not self.symmetric:
            raise ValueError(f"QuantSpec.symmetric: block scale {scale} is symmetric only")
        if scale.has_global_scale and not isinstance(fmt, FloatFormat):
            raise ValueError(
                f"QuantSpec.format: fp8 block scales with a global scale (NVFP4) take a float "
                f"element format, got {fmt.name}")
        if self.eps is not None:  # numpy's numbers too, kept as Python ones (to_dict: JSON)
            eps = as_number(self.eps)
            if eps is None or not 0 < as_float32(eps) < math.inf:
                raise ValueError(f"QuantSpec.eps must be a positive number that float32 holds "
                                 f"(scales are float32: 1e-45 to 3.4e38), got {self.eps!r}")
            object.__setattr__(self, "eps", eps)
        if self.eps is not None and scale.kind == "e8m0":
            raise ValueError(f"QuantSpec.eps: E8M0 block scales ({scale}) take no eps (an all-"
                             f"zero block gets 2**-127); leave it None, got {self.eps!r}")
        if self.eps is not None and scale.kind == "fp8_e4m3" and not _is_e4m3(self.eps):
            raise ValueError(f"QuantSpec.eps: with fp8 block scales it is the e4m3 scale of a "
                             f"block whose scale rounds to 0: need an e4m3 value in (0, 448] "
                             f"(default 0.125), got {self.eps!r}")
        if self.eps is not None and scale.kind in ("fp16", "bf16", "pow2"):
            # every scale is at least eps: the encoding must store one (its largest is what
            # it stores for float32's max)
            top = float(encode_scale(torch.tensor([_F32_MAX], dtype=torch.float32), scale))
            if as_float32(self.eps) > top:
                raise ValueError(f"QuantSpec.eps: {self.eps!r} is above the largest {scale} "
                                 f"scale ({top:.8g}); no stored scale would be at least eps")
        self._check_code_range(fmt, scale)

    def _check_code_range(self, fmt: Format, scale: ScaleEncoding) -> None:
        """quant_min / quant_max: integers, a sub-range of an integer format's codes that
        holds 0, and narrower only without a block scale (its exponent comes from emax)."""
        for name in ("quant_min", "quant_max"):
            v = getattr(self, name)
            n = None if v is None else as_int(v)  # numpy's too, kept as a Python int
            if v is not None and n is None:
                raise ValueError(f"QuantSpec.quant_min/quant_max: need integers or None, got "
                                 f"{name}={v!r}")
            object.__setattr__(self, name, n)
        if self.quant_min is None and self.quant_max is None:
            return
        if not isinstance(fmt, IntFormat):
            raise ValueError(  # noqa: TRY004 (issue 2: every invalid field is a ValueError)
                f"QuantSpec.quant_min/quant_max apply to integer formats only, got {fmt.name}")
        lo, hi = self.qmin, self.qmax
        if not (fmt.qmin <= lo < hi <= fmt.qmax) or int(lo) != lo or int(hi) != hi:
            raise ValueError(
                f"QuantSpec.quant_min/quant_max: need integers with {fmt.qmin} <= quant_min "
                f"< quant_max <= {fmt.qmax} for {fmt.name}, got [{lo}, {hi}]")
        # the zero point must be a code (torch.ao: "range must include 0")
        if not lo <= 0 <= hi:
            raise ValueError(f"QuantSpec.quant_min/quant_max: the code range must include 0 "
                             f"(quant_min <= 0 <= quant_max), got [{lo}, {hi}]")
        # an E8M0 exponent is sized for the format's full range (emax): a narrower one clips
        if scale.is_block and (lo, hi) != (fmt.qmin, fmt.qmax):
            raise ValueError(
                f"QuantSpec.quant_min/quant_max: block scale {scale} sizes its exponent from "
                f"{fmt.name}'s full range (emax {fmt.emax}) and cannot honour a narrower code "
                f"range; drop quant_min/quant_max or use a smaller format, got [{lo}, {hi}]")

    @property
    def qmin(self) -> float:
        """The smallest code (float formats: ``-max``): ``quant_min`` if set, else the format's."""
        return self.format.qmin if self.quant_min is None else self.quant_min

    @property
    def qmax(self) -> float:
        """The largest code (float formats: ``max``): ``quant_max`` if set, else the format's."""
        return self.format.qmax if self.quant_max is None else self.quant_max

    @property
    def min_scale(self) -> float:
        """The smallest scale: ``eps`` if given, else the encoding's ``default_eps`` (float32's
        eps; for fp8 block scales fp8's, 0.125)."""
        return self.scale.default_eps if self.eps is None else float(self.eps)

    @property
    def is_float(self) -> bool:
        """Whether the element format is a float one (fp8 / fp6 / fp4), not an integer one."""
        return self.format.is_float

    def replace(self, **changes) -> QuantSpec:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def __str__(self) -> str:
        parts = [self.format.name, self.layout.spec_name(),
                 "sym" if self.symmetric else "asym"]
        if getattr(self.layout, "order", None) is not None:  # g_idx moves columns
            parts.insert(2, "act-order")
        if self.scale.kind != "fp32":
            parts.append(f"scale={self.scale}")
        if self.quant_min is not None or self.quant_max is not None:
            parts.append(f"range=[{self.qmin},{self.qmax}]")
        if self.eps is not None:  # the smallest scale: another eps quantizes differently
            parts.append(f"eps={self.eps!r}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """A JSON-able description (``QuantSpec.from_dict`` reads it back; g_idx is not kept)."""
        return {"format": format_to_json(self.format), "layout": self.layout.spec_name(),
                "symmetric": self.symmetric, "scale": str(self.scale), "eps": self.eps,
                "quant_min": self.quant_min, "quant_max": self.quant_max}

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        return cls(**d)
