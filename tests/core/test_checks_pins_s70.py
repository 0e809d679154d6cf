"""Pins from session 70's mutation round of _checks.py: an empty float64 tensor in the
float32-range check, one float32 value per unit, the NVFP4 ops' float32 global amax and float
element format, the e8m0 op's rounding mode, the pattern checks' descent into alternatives,
the refusal's naming of a long target, and where an in-place write is refused. Each test
holds a behaviour that a small mutant of the source broke while every other test of the
module still passed."""

from __future__ import annotations

import pytest
import torch

from quantscope._checks import (
    check_e8m0_args,
    check_float32_range,
    check_op_global_amax,
    check_per_unit,
    op_float_format,
    pattern_refusal,
    regex_problem,
    write_refused,
)


def test_an_empty_float64_tensor_is_in_float32_range():
    """No value, none beyond float32: an empty float64 tensor passes (no reduction of none)."""
    empty = (torch.empty(0, dtype=torch.float64), torch.empty(0, 3).double())
    assert check_float32_range("f", *empty) is None  # no ValueError, no reduction error


def test_check_per_unit_wants_float32():
    """One float32 value per unit: a float64 tensor of the right shape is refused."""
    cpu = torch.device("cpu")
    check_per_unit("f", "scale", torch.ones(3), 3, cpu)
    with pytest.raises(ValueError, match="f: scale must be a float32 tensor of shape"):
        check_per_unit("f", "scale", torch.ones(3, dtype=torch.float64), 3, cpu)


def test_an_op_global_amax_must_be_float32():
    """The NVFP4 ops' global amax is one float32 value: one float64 value is refused."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="nvfp4_qparams: global_amax must be one float32"):
        check_op_global_amax(torch.ones(1, dtype=torch.float64), cpu, "nvfp4_qparams")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_an_op_float_format_refuses_an_integer_format(name):
    """op_float_format names the float element format, or refuses: an int format is not one."""
    assert op_float_format("fp4_e2m1", "nvfp4_qparams").name == "fp4_e2m1"
    with pytest.raises(ValueError, match="nvfp4_qparams: format must be a float format"):
        op_float_format(name, "nvfp4_qparams")


@pytest.mark.parametrize("mode", ["round", "FLOOR", ""])
def test_the_e8m0_op_refuses_a_mode_it_does_not_know(mode):
    """e8m0_block_scales takes one of E8M0_MODES (floor, ceil, even, rceil), no other."""
    lo, hi = torch.zeros(2), torch.ones(2)
    check_e8m0_args(lo, hi, "fp4_e2m1", "rceil")
    with pytest.raises(ValueError, match="e8m0_block_scales: mode must be one of"):
        check_e8m0_args(lo, hi, "fp4_e2m1", mode)


@pytest.mark.parametrize("pattern", ["x|(a+)+", "x|(?:ab|cd)*y"])
def test_nested_repeats_inside_alternatives_are_found(pattern):
    """A nested quantifier in one branch of an alternation backtracks just as badly."""
    assert "nested quantifiers" in regex_problem(pattern)


@pytest.mark.parametrize("length, cut", [(80, False), (81, True)])
def test_a_refused_target_is_named_by_its_first_80_characters(length, cut):
    """The refusal names the target's first 80 characters, with `` ...`` only when cut."""
    target = "re:(a+)+" + "b" * (length - 8)
    said = pattern_refusal(target)
    assert said.startswith(f"{target[:80]!r}{' ...' if cut else ''} repeats a part")


def test_an_inference_tensor_is_writable_inside_inference_mode():
    """torch refuses an in-place write of an inference tensor only outside inference_mode."""
    with torch.inference_mode():
        t = torch.zeros(2)
        assert not write_refused(t)
    assert write_refused(t)
    assert not write_refused(torch.zeros(2))
