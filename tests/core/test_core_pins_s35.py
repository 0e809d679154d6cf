"""Pins of behaviours no test held (mutation run s35): ModelOpt's float ``num_bits`` as the
formats they name, llm-compressor's patience rounded up, and a FloatFormat's max of 0
refused."""

import itertools
import math

import numpy as np
import pytest
import torch

from quantscope.compat.modelopt_spec import modelopt_spec
from quantscope.estimators.mse import compat_patience
from quantscope.formats import FloatFormat


# ---------------------------------------------------------------- ModelOpt's (E, M) bits
@pytest.mark.parametrize("bits, name, top", [
    ((4, 3), "fp8_e4m3", 448.0),  # OCP e4m3fn: S.1111.110 = 1.75 * 2 ** 8
    ((5, 2), "fp8_e5m2", 57344.0),  # IEEE-like e5m2: 1.75 * 2 ** 15
    ((2, 1), "fp4_e2m1", 6.0),  # OCP MX fp4: 1.5 * 2 ** 2
])
def test_modelopt_float_bits_are_the_formats_of_those_bits(bits, name, top):
    fmt = modelopt_spec(bits).format
    assert isinstance(fmt, FloatFormat)
    assert (fmt.name, fmt.ebits, fmt.mbits, fmt.max) == (name, *bits, top)
    assert modelopt_spec(list(bits), axis=0).format == fmt  # a list, per channel: the same


# ---------------------------------------------------------------- llm-compressor's patience
def _stops_after(patience):
    """llm-compressor's loop: ``no_improve += 1`` per candidate without improvement, stop
    once ``no_improve >= patience``: the candidates without improvement it tries."""
    return next(n for n in itertools.count(1) if n >= patience)


@pytest.mark.parametrize("patience", [np.float32(4.5), 4.5, 1.2, 0.5, 1.0, 3, 2.0001,
                                      np.float64(6.99)])
def test_compat_patience_is_where_llmcompressor_stops(patience):
    got = compat_patience(patience)
    assert got == _stops_after(float(patience)) == max(1, math.ceil(patience))
    assert type(got) is int


def test_compat_patience_pins_rounding_up():
    assert compat_patience(np.float32(4.5)) == 5 and compat_patience(1.2) == 2
    assert compat_patience(float("inf")) is None and compat_patience(None) is None


# ---------------------------------------------------------------- FloatFormat.max
@pytest.mark.parametrize("top", [0.0, -0.0, 0, np.float32(0.0), -1.0])
def test_a_float_format_with_no_positive_max_is_refused(top):
    with pytest.raises(ValueError, match=r"FloatFormat\.max must be a positive"):
        FloatFormat("x", ebits=4, mbits=3, max=top)


def test_the_smallest_positive_max_on_the_grid_is_taken():
    # the counterpart: a positive max on the e4m3 grid (its smallest subnormal) stays allowed
    tiny = 2.0 ** -9
    assert FloatFormat("x", ebits=4, mbits=3, max=tiny).max == tiny
    assert FloatFormat("x", ebits=4, mbits=3, max=448.0).max == 448.0
    with pytest.raises(ValueError, match="max"):
        FloatFormat("x", ebits=4, mbits=3, max=float(torch.finfo(torch.float32).max) * 2)
