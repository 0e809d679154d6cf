"""Pins from session 66's mutation round of quantscope.scales: the ScaleEncoding properties
per kind (is_block, has_global_scale, default_eps, its name), encode_scale's float32 result,
smallest_scale_at_least's bound for each encoding, not_encoded for fp32 / fp16 / bf16,
and e8m0_scale's default mode. Each test holds a behaviour that a mutant broke while every
existing test of the module kept passing; expected values come from the docstrings and the
formats' definitions, not from a run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantscope.formats import FP4_E2M1
from quantscope.scales import (
    ScaleEncoding,
    e8m0_scale,
    encode_scale,
    not_encoded,
    smallest_scale_at_least,
)

F32_EPS = 2.0**-23


@pytest.mark.parametrize("name, is_block, has_global, eps, text", [
    ("fp32", False, False, F32_EPS, "fp32"),
    ("fp16", False, False, F32_EPS, "fp16"),
    ("bf16", False, False, F32_EPS, "bf16"),
    ("pow2", False, False, F32_EPS, "pow2:round"),
    ("e8m0", True, False, F32_EPS, "e8m0:floor"),
    ("fp8_e4m3", True, True, 0.125, "fp8_e4m3"),
])
def test_encoding_properties_per_kind(name, is_block, has_global, eps, text):
    """Block scales are E8M0 and fp8 ones; only fp8 (NVFP4) has a global scale; eps is
    float32's but for fp8; the name shows a mode only where the kind has modes (defaulted)."""
    enc = ScaleEncoding.parse(name)
    assert enc.is_block is is_block
    assert enc.has_global_scale is has_global
    assert enc.default_eps == eps
    assert str(enc) == text
    assert ScaleEncoding.parse(str(enc)) == enc


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "pow2:floor", "pow2:ceil",
                                  "fp8_e4m3"])
def test_encoded_scales_are_float32(name):
    """A scale is a float32 ``amax / format_max``; the stored form is returned as float32."""
    got = encode_scale(torch.tensor([0.3, 1.0, 5.0]), name)
    assert got.dtype == torch.float32


def _next_up(x: float, dtype: np.dtype) -> float:
    return float(np.nextafter(dtype.type(x), dtype.type(np.inf)))


def _bf16_at_least(v: float) -> float:
    """The smallest bfloat16 >= float32 v: truncate the float32 bits, step up if below."""
    bits = int(np.float32(v).view(np.uint32)) & ~0xFFFF
    t = float(np.uint32(bits).view(np.float32))
    return t if t >= v else float(np.uint32(bits + 0x10000).view(np.float32))


def test_smallest_scale_at_least_is_eps_where_the_encoding_stores_it():
    """0.25 is a power of two, an fp16, a bf16 and an e4m3 value: the bound is eps itself."""
    for name in ["pow2:round", "pow2:floor", "pow2:ceil", "fp16", "bf16", "fp8_e4m3"]:
        assert smallest_scale_at_least(0.25, ScaleEncoding.parse(name)) == 0.25, name


def test_smallest_scale_at_least_steps_up_to_the_next_stored_value():
    """Where eps encodes below itself, the bound is the next stored value above eps."""
    eps32 = float(np.float32(0.3))
    # pow2: 0.3 rounds / floors to 0.25; the smallest power of two >= 0.3 is 0.5
    assert smallest_scale_at_least(0.3, ScaleEncoding("pow2", "floor")) == 0.5
    assert smallest_scale_at_least(0.3, ScaleEncoding("pow2", "round")) == 0.5
    # fp16: 0.3 rounds to the fp16 below it
    h = float(np.float16(0.3))
    want = h if h >= eps32 else _next_up(h, np.dtype(np.float16))
    assert want > eps32 and smallest_scale_at_least(0.3, ScaleEncoding("fp16")) == want
    # bf16: the docstring's 0.001 -> 0.000999; the bound is the bf16 just above 0.001
    want = _bf16_at_least(float(np.float32(0.001)))
    assert want > 0.001 and smallest_scale_at_least(0.001, ScaleEncoding("bf16")) == want
    # e4m3 in [0.25, 0.5) steps by 2 ** -5: 0.29 rounds to 0.28125, the next one is 0.3125
    assert smallest_scale_at_least(0.29, ScaleEncoding("fp8_e4m3")) == 0.3125


def test_not_encoded_fp16_and_bf16_are_their_dtypes_values():
    """fp16 holds 10 fraction bits, bf16 7: 1 + 2**-8 is an fp16 but no bf16, 1/3 is neither,
    1.5 and 65504 (fp16's max) are both."""
    s = torch.tensor([1.5, 1 + 2.0**-8, 1 / 3, 65504.0, 1 + 2.0**-11])
    assert not_encoded(s, ScaleEncoding("fp16")).tolist() == [False, False, True, False, True]
    assert not_encoded(s, ScaleEncoding("bf16")).tolist() == [False, True, True, True, True]


def test_not_encoded_fp32_holds_any_value():
    """fp32 holds any scale: nothing is flagged, NaN and inf included."""
    s = torch.tensor([0.3, math.nan, math.inf, 1e-45])
    out = not_encoded(s, ScaleEncoding("fp32"))
    assert out.dtype == torch.bool and not out.any()


def test_e8m0_scale_defaults_to_the_floor_mode():
    """OCP MX v1.0's floor rule is the default: 7.9 in e2m1 (emax 2) gives 2 ** (2 - 2), where
    'even' would round its mantissa 1.975 up to 2 and give 2 ** 1."""
    amax = torch.tensor([7.9, 6.0, 0.75])
    assert e8m0_scale(amax, FP4_E2M1).tolist() == [1.0, 1.0, 0.125]
    assert e8m0_scale(amax, FP4_E2M1, "even").tolist() == [2.0, 1.0, 0.125]
