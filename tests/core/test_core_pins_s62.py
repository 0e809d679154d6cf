"""Pins from session 62's mutation round of the core numerics (qdq, qparams, scales, formats,
layout, _numerics): behaviour each of these tests alone holds (a mutant that broke it left
every test that names its function passing). Expected values come from the formulas and the
documented rules, not from a run."""

from __future__ import annotations

import numpy as np
import torch

from quantscope import QuantSpec
from quantscope.layout import Tensor, Token
from quantscope.qdq import clip_edges, fake_quantize
from quantscope.qparams import QParams
from quantscope.scales import ScaleEncoding, smallest_scale_at_least


def test_clip_edges_are_the_values_of_the_codes_qmin_and_qmax():
    """clip_edges (the report's clip_lo / clip_hi) are the dequantized ends of the code range,
    ``(qmin - zero_point) * scale`` and ``(qmax - zero_point) * scale``: int8 with scale 0.5,
    zero point 3 clips at (-128 - 3) * 0.5 = -65.5 and (127 - 3) * 0.5 = 62; with 0.25 and
    -10 at -29.5 and 34.25. They are what fake_quantize saturates far values to."""
    spec = QuantSpec(format="int8", symmetric=False, layout="channel")
    qp = QParams(torch.tensor([[0.5], [0.25]]), torch.tensor([[3], [-10]], dtype=torch.int32))
    lo, hi = clip_edges(qp, spec, 2)
    assert lo.tolist() == [[-65.5], [-29.5]]
    assert hi.tolist() == [[62.0], [34.25]]
    far = fake_quantize(torch.tensor([[-1e9, 1e9], [-1e9, 1e9]]), qp, spec)
    assert torch.equal(far, torch.cat([lo, hi], dim=1))


def test_a_0d_tensors_token_qparams_are_one_scale_of_shape_1():
    """Token's qparam shape is ``(*leading, 1)``; a 0-d tensor has no leading dims, so it is
    ``(1,)``: one unit (to_units makes it ``[1, 1]``), shaped as Tensor's one scale, not a
    0-d ``()`` that a reshape of the units' one value would have to guess."""
    x = torch.tensor(2.0)
    assert Token().qparam_shape(()) == (1,) == Tensor().qparam_shape(())
    assert tuple(Token().to_units(x).shape) == (1, 1)


def test_the_fp32_eps_bound_is_a_float32_value():
    """smallest_scale_at_least gives a scale the encoding stores: for fp32 that is eps rounded
    to float32 (numpy's float32 rounding, to nearest), never the Python double itself: 0.1
    is 0.100000001490116..., the value a float32 scale clamped there holds."""
    got = smallest_scale_at_least(0.1, ScaleEncoding("fp32"))
    assert got == float(np.float32(0.1)) != 0.1
    assert smallest_scale_at_least(2.0**-126, ScaleEncoding("fp32")) == 2.0**-126
