"""Pins from session 67's mutation round of quantscope.qdq and quantscope.presets: behaviour
that a mutant broke while every test covering the modules passed. Expected values come from
the modules' docstrings and formulas (``q = round(x / scale + zero_point)`` clamped to
``[qmin, qmax]``, ``x' = (q - zero_point) * scale``, saturation to the dtype's finite range,
the SPECS table's names for the presets), not from a run."""

from __future__ import annotations

import pytest
import torch

from quantscope import QuantSpec, dequantize, fake_quantize, presets, quantize
from quantscope.qdq import clip_edges
from quantscope.qparams import QParams


def _qp(scale):
    """One unit: a float32 scale and an int32 zero point of 0."""
    return QParams(torch.tensor([float(scale)]), torch.zeros(1, dtype=torch.int32))


def test_zero_point_on_another_device_than_the_scale_is_refused():
    """The device check compares the zero point with the scale too, not only the input."""
    q = QParams(torch.tensor([0.5]), torch.zeros(1, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"cpu \(scale\) and meta \(zero_point\)"):
        quantize(torch.ones(3), q, QuantSpec("int8"), check=False)


def test_one_unit_with_a_zero_point_of_two_values_is_refused():
    """The count check takes the scale and the zero point each: one unit (a per-tensor spec,
    where the shape check does not run) with a right scale but two zero points is a
    ``ValueError``."""
    q = QParams(torch.tensor([0.5]), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="zero_point 2"):
        quantize(torch.ones(3), q, QuantSpec("int8"), check=False)


def test_two_d_rows_scales_run_on_a_three_d_activation():
    """Leading 1s aside: the ``(1, C)`` per-channel scales of 2-D rows run on a ``[B, T, C]``
    activation (whose layout shape is ``(1, 1, C)``), channel by channel."""
    spec = QuantSpec("int8", "channel:-1")
    scale = torch.tensor([[0.5, 1.0, 2.0, 4.0]])
    q = QParams(scale, torch.zeros(1, 4, dtype=torch.int32))
    x = torch.tensor([1.0, 1.0, 1.0, 1.0]).expand(2, 3, 4)
    # 1 / scale: 2, 1, 0.5 (to even: 0), 0.25 (0)
    want = torch.tensor([2.0, 1.0, 0.0, 0.0]).expand(2, 3, 4)
    assert torch.equal(quantize(x, q, spec), want)


def test_an_empty_global_scale_is_refused():
    """``global_scale`` must hold one value: an empty one is refused as two are, before any
    read (``check=False`` too)."""
    q = QParams(torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(0))
    with pytest.raises(ValueError, match=r"global_scale must have one value.*\(0,\)"):
        quantize(torch.ones(16), q, presets.NVFP4, check=False)


def test_clip_edges_of_nvfp4_divide_the_block_scale_by_the_global_scale():
    """clip_edges are the codes' ends times the effective scale, ``scale / global_scale``:
    fp4's +-6 with block scales 3 and 0.5 under a global scale of 2 clip at +-9 and +-1.5."""
    qp = QParams(torch.tensor([3.0, 0.5]), torch.zeros(2, dtype=torch.int32), torch.tensor([2.0]))
    lo, hi = clip_edges(qp, presets.NVFP4, 2)
    assert lo.tolist() == [[-9.0], [-1.5]]
    assert hi.tolist() == [[9.0], [1.5]]


@pytest.mark.parametrize(("name", "constant"), [
    ("int8", "INT8_PER_TENSOR"), ("int8-channel", "INT8_PER_CHANNEL"),
    ("int8-token", "INT8_PER_TOKEN"), ("int4-g128", "INT4_GROUP128"),
    ("int4-g128-asym", "INT4_GROUP128_ASYM"), ("fp8", "FP8_PER_TENSOR"),
    ("fp8-channel", "FP8_PER_CHANNEL"), ("mxfp8", "MXFP8"), ("mxfp6", "MXFP6_E2M3"),
    ("mxfp6-e2m3", "MXFP6_E2M3"), ("mxfp6-e3m2", "MXFP6_E3M2"), ("mxfp4", "MXFP4"),
    ("mxint8", "MXINT8"), ("nvfp4", "NVFP4"), ("bfp16", "BFP16"),
])
def test_each_spec_name_is_its_constant(name, constant):
    """The SPECS table: each name gives the constant it names (plain ``mxfp6`` is E2M3), in
    any case."""
    assert presets.get(name) is getattr(presets, constant)
    assert presets.get(name.upper()) is getattr(presets, constant)


def test_half_results_saturate_at_float16s_max_not_inf():
    """Results saturate to the dtype's finite range: the int8 code -128 with scale 512 is
    -65536 in float32, past float16's 65504, so a float16 result is -65504, not -inf; -65504
    itself quantizes to that code (-127.94 rounds to -128)."""
    qp = _qp(512.0)
    spec = QuantSpec("int8")
    out = dequantize(torch.tensor([-128.0, 127.0]), qp, spec, torch.float16)
    assert out.dtype == torch.float16
    assert out.tolist() == [-65504.0, 65024.0]
    x = torch.tensor([-65504.0, 65504.0], dtype=torch.float16)
    assert fake_quantize(x, qp, spec).tolist() == [-65504.0, 65024.0]


def test_dequantize_refuses_codes_outside_a_narrower_quant_range():
    """dequantize's check is against the spec's ``[qmin, qmax]``: with int8 narrowed to
    [-64, 63], 64 and -65 are no codes (though int8's), while -64 and 63 still run."""
    spec = QuantSpec("int8", quant_min=-64, quant_max=63)
    assert dequantize(torch.tensor([-64.0, 63.0]), _qp(0.5), spec).tolist() == [-32.0, 31.5]
    for code in (64.0, -65.0):
        with pytest.raises(ValueError, match=r"q must hold codes .*\[-64, 63\]"):
            dequantize(torch.tensor([code]), _qp(0.5), spec)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ste_of_a_half_input_is_zero_where_it_clipped(dtype):
    """The straight-through mask is taken on the input, not on its QDQ result (which lies on
    the range's end, inside): a float16 / bfloat16 1000 with int8 scale 1 clips at 127, so its
    gradient is 0; 3 and -128 are inside (1)."""
    x = torch.tensor([1000.0, 3.0, -128.0, -1000.0], dtype=dtype, requires_grad=True)
    out = fake_quantize(x, _qp(1.0), QuantSpec("int8"), ste=True)
    assert out.tolist() == [127.0, 3.0, -128.0, -128.0]
    out.sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_codes_clamp_to_a_narrower_quant_range_than_the_formats():
    """``quant_min`` / ``quant_max`` (torch.ao's reduce_range) are the code range QDQ clamps
    to: int8 in [-64, 63] with scale 1 gives codes -64 and 63 for +-1000, not int8's ends."""
    spec = QuantSpec("int8", quant_min=-64, quant_max=63)
    x = torch.tensor([-1000.0, 1000.0, 5.0])
    assert quantize(x, _qp(1.0), spec).tolist() == [-64.0, 63.0, 5.0]
    assert fake_quantize(x, _qp(0.5), spec).tolist() == [-32.0, 31.5, 5.0]
