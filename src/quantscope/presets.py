"""Ready-made specs for the common schemes, by constant or by name (:func:`get`)."""

from __future__ import annotations

from .layout import Block, Channel, Group, Tensor, Token
from .spec import QuantSpec

__all__ = [
    "BFP16",
    "FP8_PER_CHANNEL",
    "FP8_PER_TENSOR",
    "INT4_GROUP128",
    "INT4_GROUP128_ASYM",
    "INT8_PER_CHANNEL",
    "INT8_PER_TENSOR",
    "INT8_PER_TOKEN",
    "MXFP4",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8",
    "MXINT8",
    "NVFP4",
    "PRESETS",
    "SPECS",
    "get",
]

INT8_PER_TENSOR = QuantSpec("int8", Tensor())
INT8_PER_CHANNEL = QuantSpec("int8", Channel(0))
INT8_PER_TOKEN = QuantSpec("int8", Token())
INT4_GROUP128 = QuantSpec("int4", Group(128))
INT4_GROUP128_ASYM = QuantSpec("int4", Group(128), symmetric=False)
FP8_PER_TENSOR = QuantSpec("fp8_e4m3", Tensor())
FP8_PER_CHANNEL = QuantSpec("fp8_e4m3", Channel(0))
# OCP MX v1.0: blocks of 32, E8M0 shared scale, the spec's floor rule.
MXFP8 = QuantSpec("fp8_e4m3", Block(32), scale="e8m0:floor")
MXFP6_E2M3 = QuantSpec("fp6_e2m3", Block(32), scale="e8m0:floor")
MXFP6_E3M2 = QuantSpec("fp6_e3m2", Block(32), scale="e8m0:floor")
MXFP4 = QuantSpec("fp4_e2m1", Block(32), scale="e8m0:floor")
# MXINT8: codes in [-127, 127] with scale 2**(floor(log2 amax) - 6) (the spec's int8 / 64).
MXINT8 = QuantSpec("int8_narrow", Block(32), scale="e8m0:floor")
# NVFP4: blocks of 16, e4m3 block scales under an fp32 per-tensor global scale.
NVFP4 = QuantSpec("fp4_e2m1", Block(16), scale="fp8_e4m3")
# BFP16 (Quark): blocks of 8, shared exponent floor(log2 amax) - 6, 8-bit signed mantissas;
# the exponent moves up when the largest mantissa would round to 128 ('even'). Symmetric
# mantissas in [-127, 127]: Quark keeps two's complement [-128, 127] and checks only the
# positive side, so a block whose largest magnitude is negative and rounds to -128 keeps
# Quark's exponent (code -128) where ours moves up.
BFP16 = QuantSpec("int8_narrow", Block(8), scale="e8m0:even")

#: spec name -> QuantSpec (the "specs"; recipes are :data:`quantscope.calibration.RECIPES`)
SPECS: dict[str, QuantSpec] = {
    "int8": INT8_PER_TENSOR, "int8-channel": INT8_PER_CHANNEL, "int8-token": INT8_PER_TOKEN,
    "int4-g128": INT4_GROUP128, "int4-g128-asym": INT4_GROUP128_ASYM,
    "fp8": FP8_PER_TENSOR, "fp8-channel": FP8_PER_CHANNEL,
    "mxfp8": MXFP8, "mxfp6": MXFP6_E2M3, "mxfp6-e2m3": MXFP6_E2M3, "mxfp6-e3m2": MXFP6_E3M2,
    "mxfp4": MXFP4, "mxint8": MXINT8, "nvfp4": NVFP4, "bfp16": BFP16,
}


#: the earlier name of :data:`SPECS`
PRESETS = SPECS


def get(name: str) -> QuantSpec:
    """A spec by name (see :data:`SPECS`)."""
    if not isinstance(name, str):
        raise TypeError(f"preset: name must be a str (one of {sorted(SPECS)}), got "
                        f"{type(name).__name__}")
    try:
        return SPECS[name.lower()]
    except KeyError:
        raise ValueError(f"preset: unknown {name!r}; expected one of {sorted(SPECS)}") from None
