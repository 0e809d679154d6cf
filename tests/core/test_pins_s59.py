"""Pins from session 59's mutation round of the core numerics: behaviour each of these tests
alone holds (a mutant that broke it left every other test passing)."""

from __future__ import annotations

import pytest
import torch

from quantscope import QuantSpec
from quantscope.formats import FloatFormat
from quantscope.layout import Channel, Group, Tile, parse_layout
from quantscope.qdq import fake_quantize, quantize
from quantscope.qparams import QParams, qparams_from_range
from quantscope.scales import ScaleEncoding, not_encoded


@pytest.mark.parametrize("scale", ["fp16", "bf16", "pow2"])
@pytest.mark.parametrize(("lo", "hi", "widened"), [(1.0, 2.0, (0.0, 2.0)),
                                                   (-2.0, -1.0, (-2.0, 0.0))])
def test_an_asymmetric_range_is_widened_to_hold_zero_on_the_torch_path(scale, lo, hi, widened):
    # the non-fp32 scale encodings take the torch path on the CPU too: a range off zero is
    # priced as its widening (without it, [1, 2] got half the scale and clipped 2 to ~0.5)
    spec = QuantSpec(format="int8", symmetric=False, scale=scale)
    got = qparams_from_range(torch.tensor([lo]), torch.tensor([hi]), spec)
    want = qparams_from_range(*(torch.tensor([v]) for v in widened), spec)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.zero_point, want.zero_point)
    x = torch.tensor([lo, hi])
    # (pow2 rounds the scale down: the top may lose a step, never half the range)
    assert torch.allclose(fake_quantize(x, got, spec), x, atol=float(got.scale) * 1.01)


@pytest.mark.parametrize("fn", [quantize, fake_quantize])
@pytest.mark.parametrize("zp", [-200, 128])
def test_a_zero_point_outside_the_codes_is_refused_on_either_side(fn, zp):
    spec = QuantSpec(format="int8", symmetric=False)
    qp = QParams(torch.tensor([0.1]), torch.tensor([zp], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"zero_point must be integers in the code range "
                                         r"\[-128, 127\]"):
        fn(torch.tensor([0.0, 1.0]), qp, spec)


def test_e8m0_stores_only_the_powers_its_byte_holds():
    s = torch.tensor([2.0 ** -149, 2.0 ** -128, 2.0 ** -127, 1.0, 2.0 ** 127])
    assert not_encoded(s, ScaleEncoding("e8m0")).tolist() == [True, True, False, False, False]
    spec = QuantSpec(format="fp8_e4m3", layout="block:32", scale="e8m0")
    qp = QParams(torch.tensor([2.0 ** -130]), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="qparams.scale must be finite"):
        quantize(torch.ones(32), qp, spec)


def test_a_float_format_whose_step_is_below_float32s_normals_is_refused():
    # 2 ** (min_exp - mbits) = 2 ** -127: its step is a subnormal, round() gave NaN
    with pytest.raises(ValueError, match=r"2 \*\* -127 .*must be a normal float32"):
        FloatFormat("e8m1", 8, 1, 1.5 * 2.0 ** 127)


def test_an_empty_channel_axis_gives_empty_units_and_an_empty_result():
    x = torch.empty(0, 4)
    assert tuple(Channel(0).to_units(x).shape) == (0, 0)
    qp = QParams(torch.empty(0, 1), torch.empty(0, 1, dtype=torch.int32))
    assert tuple(fake_quantize(x, qp, QuantSpec(format="int8", layout="channel:0")).shape) \
        == (0, 4)


def test_a_tile_of_one_number_is_square():
    assert parse_layout("tile:64") == Tile(64, 64)
    assert parse_layout("tile:64x32") == Tile(64, 32)


@pytest.mark.parametrize("check_finite", [True, False])
def test_nvfp4_qparams_of_no_blocks_have_global_scale_one(check_finite):
    spec = QuantSpec(format="fp4_e2m1", layout="block:16", scale="fp8_e4m3")
    qp = qparams_from_range(torch.empty(0), torch.empty(0), spec, check_finite=check_finite)
    assert qp.global_scale.tolist() == [1.0]


def test_a_negative_group_index_is_refused_naming_g_idx():
    with pytest.raises(ValueError, match=r"g_idx must hold group indices >= 0, got -1"):
        Group(2, g_idx=torch.tensor([0, 0, -1, 1]))
