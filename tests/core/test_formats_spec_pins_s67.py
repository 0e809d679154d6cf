"""Pins of format-table and QuantSpec behaviours no test held (mutation round s67): the
aliases and case of format names, the integer formats' ``mbits``, ``emax`` below 1, float
rounding's explicit bounds, a custom format's dict keys, the argument conversion helpers,
and QuantSpec's e4m3 eps bound, code ranges that end at 0, a block scale's full range and
the one-sided range in ``str``."""

import math

import numpy as np
import pytest
import torch

from quantscope import QuantSpec
from quantscope.formats import (
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    INT8,
    FloatFormat,
    IntFormat,
    as_number,
    get_format,
    tensor_arg,
)
from quantscope.layout import Block


# ---------------------------------------------------------------- the format table
@pytest.mark.parametrize("alias, fmt", [
    ("e4m3", FP8_E4M3), ("fp8_e4m3fn", FP8_E4M3), ("e5m2", FP8_E5M2), ("fp4", FP4_E2M1),
])
def test_every_alias_reads_as_its_built_in_format(alias, fmt):
    assert get_format(alias) is fmt


def test_format_names_are_read_in_any_case():
    assert get_format("INT8") is INT8 and get_format("FP8_E5M2") is FP8_E5M2
    assert get_format("Int4_Narrow") == IntFormat(4, narrow=True)
    assert get_format("UINT3") == IntFormat(3, signed=False)


@pytest.mark.parametrize("name", ["int8x", "int-3", "uint", "int_narrow"])
def test_an_int_prefix_without_a_bit_count_is_an_unknown_name(name):
    with pytest.raises(ValueError, match="format: unknown name"):
        get_format(name)


@pytest.mark.parametrize("bits", range(2, 17))
def test_int_mbits_are_the_bits_below_the_leading_one_of_qmax(bits):
    """MX 'even' rounding takes ``mbits`` as the fraction bits at full scale: int8's 127 is
    0b1111111, six bits below its leading one; uint8's 255 seven."""
    for fmt in (IntFormat(bits), IntFormat(bits, signed=False)):
        assert fmt.mbits == fmt.qmax.bit_length() - 1 == fmt.emax


@pytest.mark.parametrize("top, emax", [(0.75, -1), (0.375, -2), (2.0 ** -9, -9), (448.0, 8)])
def test_float_emax_is_floor_log2_max_below_1_too(top, emax):
    """``floor(log2(max))``: 0.75 lies in [2 ** -1, 2 ** 0), so -1 (not a truncation to 0)."""
    f = FloatFormat("x", 4, 3, top)
    assert f.emax == emax and 2.0 ** f.emax <= f.max < 2.0 ** (f.emax + 1)


def test_float_round_takes_explicit_bounds():
    """Unbounded, e4m3 values past 448 round on the grid of their binade (1000: step
    2 ** (9 - 3) = 64, 15.625 steps -> 1024); bounds given clamp there instead of at max."""
    inf = math.inf
    x = torch.tensor([1000.0, -1000.0, 3.1])
    assert FP8_E4M3.round(x, -inf, inf).tolist() == [1024.0, -1024.0, 3.0]
    assert FP8_E4M3.round(x.clone(), -inf, inf, inplace=True).tolist() == [1024.0, -1024.0, 3.0]
    assert FP4_E2M1.round(torch.tensor([-5.0, 2.6, 5.1]), 0.0, 4.0).tolist() == [0.0, 3.0, 4.0]


def test_a_float_format_dict_with_an_unknown_key_is_refused_naming_the_fields():
    d = {"name": "x", "ebits": 4, "mbits": 3, "max": 448.0, "torch_dtype": None, "bias": 7}
    with pytest.raises(ValueError, match=r"format: a dict describes a FloatFormat .*'bias'"):
        get_format(d)


# ---------------------------------------------------------------- argument conversion
def test_as_number_keeps_integers_as_python_ints():
    for v in (3, np.int64(3), np.int8(3)):
        got = as_number(v)
        assert type(got) is int and got == 3
    assert type(as_number(np.float32(0.5))) is float and as_number(True) is None


def test_tensor_arg_takes_a_reversed_numpy_view():
    got = tensor_arg("who", "x", np.arange(4)[::-1], "a tensor")
    assert got.tolist() == [3, 2, 1, 0]


@pytest.mark.parametrize("value", [None, "abc"])
def test_tensor_arg_names_the_call_and_the_argument(value):
    with pytest.raises(TypeError, match=r"who: x must be a tensor, got (NoneType|str)"):
        tensor_arg("who", "x", value, "a tensor")


# ---------------------------------------------------------------- QuantSpec
def test_nvfp4_eps_may_be_e4m3s_largest_value():
    """The bound is (0, 448]: 448 itself is an e4m3 value."""
    spec = QuantSpec("fp4", Block(16), scale="fp8_e4m3", eps=448.0)
    assert spec.min_scale == 448.0


def test_eps_is_compared_to_the_largest_scale_as_float32():
    """Scales are float32: an eps that float32 holds as fp16's 65504 is no larger."""
    assert np.float32(65504.001) == 65504.0
    assert QuantSpec("int8", scale="fp16", eps=65504.001).eps == 65504.001


def test_a_code_range_may_end_at_0():
    spec = QuantSpec("int8", symmetric=False, quant_min=-8, quant_max=0)
    assert (spec.qmin, spec.qmax) == (-8, 0)


@pytest.mark.parametrize("fmt, lo, hi", [("int8", -127, None), ("int8", -127, 127),
                                         ("int4", None, 6)])
def test_a_block_scale_refuses_a_range_narrower_on_either_side(fmt, lo, hi):
    with pytest.raises(ValueError, match="cannot honour a narrower code range"):
        QuantSpec(fmt, Block(32), scale="e8m0", quant_min=lo, quant_max=hi)


def test_str_shows_a_one_sided_code_range_with_the_formats_other_end():
    assert str(QuantSpec("int8", quant_min=-64)) == "int8 tensor sym range=[-64,127]"
    assert str(QuantSpec("uint8", symmetric=False, quant_max=127)) == \
        "uint8 tensor asym range=[0,127]"
