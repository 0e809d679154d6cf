"""Pins from session 70's mutation round of quantscope.scales: e8m0_scale reading an element
format given as format_to_json's dict, not_encoded flagging a non-finite E8M0 scale,
smallest_scale_at_least reading eps in float32 and stepping up from an fp8 scale that rounds
to 0, and nvfp4_global_scale's block format and float32 result. Each test holds a behaviour
that a mutant broke while every existing test of the module kept passing; expected values
come from the docstrings and the formats' definitions, not from a run."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope.formats import FP4_E2M1, FP8_E5M2
from quantscope.scales import (
    ScaleEncoding,
    e8m0_scale,
    not_encoded,
    nvfp4_global_scale,
    smallest_scale_at_least,
)


def test_e8m0_scale_reads_a_custom_format_dict():
    """fmt may be format_to_json's dict, as QuantSpec reads it: an e2m1 capped at 4 (emax 2).
    rceil gives the smallest 2 ** k with 5 <= 4 * 2 ** k: 2; floor gives 2 ** (2 - 2)."""
    fmt = {"name": "e2m1_cap4", "ebits": 2, "mbits": 1, "max": 4.0}
    amax = torch.tensor([5.0])
    assert e8m0_scale(amax, fmt, "rceil").tolist() == [2.0]
    assert e8m0_scale(amax, fmt, "floor").tolist() == [1.0]


def test_not_encoded_e8m0_flags_non_finite_scales():
    """E8M0 stores 2 ** k for k in [-127, 127] only: inf and NaN are not among them,
    2 ** 127 is."""
    s = torch.tensor([math.inf, math.nan, 2.0**127])
    assert not_encoded(s, ScaleEncoding("e8m0")).tolist() == [True, True, False]


@pytest.mark.parametrize("name", ["fp16", "bf16", "pow2:floor", "pow2:round", "fp8_e4m3"])
def test_smallest_scale_at_least_reads_eps_in_float32(name):
    """0.25 + 2 ** -30 is 0.25 in float32 (its ulp there is 2 ** -25), which every encoding
    stores: the bound is 0.25, not the next stored value above it."""
    assert smallest_scale_at_least(0.25 + 2.0**-30, ScaleEncoding.parse(name)) == 0.25


def test_smallest_scale_at_least_fp8_steps_up_from_a_scale_that_rounds_to_zero():
    """1e-5 rounds to 0 in e4m3 (below half its smallest subnormal, 2 ** -9): the bound is
    that subnormal, the smallest positive e4m3 value."""
    assert smallest_scale_at_least(1e-5, ScaleEncoding("fp8_e4m3")) == 2.0**-9


def test_nvfp4_global_scale_uses_the_block_format_given():
    """block_max * format_max / amax with the block format passed: e5m2 (max 57344)."""
    gs = nvfp4_global_scale(torch.tensor([2.0, 6.0]), FP4_E2M1, FP8_E5M2)
    assert gs.tolist() == [57344.0 * 6 / 2, 57344.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_nvfp4_global_scale_is_float32_for_a_half_amax(dtype):
    """The global scale is fp32: 448 * 6 / 0.01 (about 268800) is past fp16's max, and
    must neither overflow to inf (and fall back to 1) nor come back in the half dtype."""
    amax = torch.tensor([0.01, 1.0], dtype=dtype)
    gs = nvfp4_global_scale(amax, FP4_E2M1)
    assert gs.dtype == torch.float32
    assert torch.equal(gs, 2688.0 / amax.float())
