"""Pins of format construction checks no test held (mutation round s71): a float format's
name must be a non-empty string and its torch dtype a ``torch.dtype``, its smallest step
``2 ** (min_exp - mbits)`` must be a normal float32 (``>= 2 ** -126``, so e8m1 and e7m65 are
refused), numpy flags and a numpy ``max`` are kept as the Python values (a custom format's JSON
dumps), and ``tensor_arg`` turns torch's ``OverflowError`` (an int too large for float32)
into the ``TypeError`` that names the call and the argument."""

import json

import numpy as np
import pytest
import torch

from quantscope.formats import FloatFormat, IntFormat, format_to_json, tensor_arg


def test_a_float_format_with_an_empty_name_is_refused():
    with pytest.raises(ValueError, match=r"FloatFormat\.name must be a non-empty string"):
        FloatFormat("", 2, 1, 6.0)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", 1])
def test_a_float_format_torch_dtype_that_is_no_torch_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=r"FloatFormat\.torch_dtype must be a torch\.dtype"):
        FloatFormat("x", 4, 3, 448.0, dtype)


@pytest.mark.parametrize("ebits, mbits", [(8, 1), (7, 65)])
def test_a_smallest_step_one_binade_below_float32_normals_is_refused(ebits, mbits):
    """min_exp - mbits = -127: the step 2 ** -127 is a float32 subnormal."""
    with pytest.raises(ValueError, match=r"2 \*\* -127 .* must be a normal float32"):
        FloatFormat("x", ebits, mbits, 2.0)


def test_tensor_arg_turns_an_overflow_into_a_type_error_naming_the_argument():
    with pytest.raises(TypeError, match=r"who: x must be a real number, got int"):
        tensor_arg("who", "x", 10**400, "a real number", dtype=torch.float32)


@pytest.mark.parametrize("signed, narrow", [(np.True_, np.True_), (np.False_, np.False_)])
def test_int_format_numpy_flags_are_kept_as_python_bools(signed, narrow):
    fmt = IntFormat(4, signed=signed, narrow=narrow)
    assert fmt.signed is bool(signed) and fmt.narrow is bool(narrow)


def test_a_numpy_max_is_kept_as_a_python_float_and_the_format_dumps_to_json():
    fmt = FloatFormat("x", 2, 1, np.float32(6.0))
    assert type(fmt.max) is float and fmt.max == 6.0
    assert json.loads(json.dumps(format_to_json(fmt)))["max"] == 6.0
