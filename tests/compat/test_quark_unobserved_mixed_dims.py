"""``calculate_int_quant_params`` reads a never-observed range as Quark 0.13's
``check_min_max_valid`` does when *either* end is 0-dim (``min_val.dim() == 0 or
max_val.dim() == 0``): a one-element ``[inf]`` beside a 0-dim ``-inf`` is Quark's default
``([1.], [0])`` (it used to be an ``InvertedRangeError`` about shapes), and a several-element
side beside a 0-dim one is Quark's ``RuntimeError`` on the ambiguous bool. Expected values from
``quark/torch/quantization/nn/utils.py``; nothing imports Quark."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import quark

INF = float("inf")


def _observer():
    return quark.PerChannelMinMaxObserver({"dtype": "uint8", "symmetric": False,
                                           "qscheme": "per_channel", "ch_axis": 0})


@pytest.mark.parametrize(("lo", "hi"), [([INF], -INF), (INF, [-INF])])
def test_unobserved_default_when_either_end_is_0_dim(lo, hi):
    scale, zp = _observer().calculate_int_quant_params(torch.tensor(lo), torch.tensor(hi))
    assert (scale.tolist(), zp.tolist()) == ([1.0], [0])


@pytest.mark.parametrize(("lo", "hi"), [([INF, INF], -INF), (INF, [-INF, -INF])])
def test_several_values_beside_a_0_dim_end_is_quarks_ambiguous_bool(lo, hi):
    with pytest.raises(RuntimeError, match="ambiguous"):
        _observer().calculate_int_quant_params(torch.tensor(lo), torch.tensor(hi))
