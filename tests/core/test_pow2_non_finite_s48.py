"""Power-of-two scale encodings of non-finite scales (s48 formats probe): ``pow2:round`` read
an inf scale's exponent as ``torch.frexp(inf)``'s 0 and stored 1.0, where floor / ceil (and
every other encoding) saturate at the largest value; a NaN scale became 0.5 or 1.0 in every
pow2 mode, where fp32 / fp16 / bf16 / fp8 keep it NaN."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope import QuantSpec
from quantscope.qparams import qparams_from_range
from quantscope.scales import encode_scale

POW2 = ["pow2:round", "pow2:floor", "pow2:ceil"]


@pytest.mark.parametrize("encoding", POW2)
def test_an_inf_scale_saturates_and_a_nan_scale_stays_nan(encoding):
    got = encode_scale(torch.tensor([math.inf, math.nan, 3.0e38, 1.0]), encoding)
    assert got[0] == 2.0 ** 127 and got[2] == 2.0 ** 127
    assert math.isnan(got[1])
    assert got[3] == 1.0


@pytest.mark.parametrize("encoding", POW2 + ["fp32", "fp16", "bf16"])
def test_non_finite_ranges_unchecked_give_the_encodings_own_extremes(encoding):
    qp = qparams_from_range(torch.tensor([-1.0, -1.0]), torch.tensor([math.inf, math.nan]),
                            QuantSpec("int8", scale=encoding), check_finite=False)
    big = encode_scale(torch.tensor([torch.finfo(torch.float32).max]), encoding)  # its largest
    assert qp.scale[0] == big[0] and math.isnan(qp.scale[1])
