"""compat.quark's spec translation (``quark_spec``, ``quark_qmin_qmax``) and Quark's
``PerTensorHistogramObserverPro`` where the s65 mutation round (quark_spec.py, quark_pro.py)
found behaviour no .venv test pinned: the MX / BFP16 defaults (blocks of 32 / 8 on the last
axis, narrow int8 elements, BFP16's fixed even E8M0), the fp6 names, the block scale formats
(e4m3 as fp8_e4m3 scales, a group_size required), ``fp4_scale_formats`` and ``uniform``
(which dtypes and qschemes fall back to float32 scales), ``pad_blocks``, the class ``qscheme``
/ ``dtype`` arguments against the qspec's, float formats always symmetric, Quark's
``round_method`` 8, the int2 range, ``quark_qmin_qmax``'s ints and floats per dtype, and the
Pro's 4-bit support and ``reduce_range`` halving (torch.ao's ranges). Expected values come
from quark_spec's docstrings, the OCP MX spec and torch.ao's documented ranges; nothing
imports Quark."""

from __future__ import annotations

import pytest
import torch

from quantscope.compat import quark
from quantscope.compat.quark_spec import quark_qmin_qmax, quark_spec
from quantscope.layout import Block, Channel, Group, Tensor


def _scale(spec) -> str:
    """The spec's scale encoding as its name: ``e8m0:even``, ``fp8_e4m3``, ``fp32``."""
    kind, mode = spec.scale.kind, spec.scale.mode
    return f"{kind}:{mode}" if mode else kind


def test_mx_defaults_to_blocks_of_32_on_the_last_axis():
    """OCP MX: a shared scale per 32 elements; no ch_axis means the last axis."""
    spec = quark_spec({"dtype": "mx", "mx_element_dtype": "fp4"})
    assert spec.layout == Block(32, -1) and spec.format.name == "fp4_e2m1"


def test_mx_int8_elements_are_narrow_int8():
    """OCP MXINT8 elements are symmetric (-127..127), as the MXINT8 preset."""
    spec = quark_spec({"dtype": "mx", "mx_element_dtype": "int8", "group_size": 32})
    assert spec.format.name == "int8_narrow"
    assert (spec.format.qmin, spec.format.qmax) == (-127, 127)


def test_bfp16_defaults_to_blocks_of_8_with_even_e8m0_whatever_the_mode():
    """BFP16 (the preset): blocks of 8 on the last axis, narrow int8, E8M0 rounded even;
    the qspec's ``scale_calculation_mode`` is not BFP16's."""
    spec = quark_spec({"dtype": "bfp16", "scale_calculation_mode": "floor"})
    assert spec.format.name == "int8_narrow" and spec.layout == Block(8, -1)
    assert _scale(spec) == "e8m0:even"


@pytest.mark.parametrize("name", ["fp6_e3m2", "fp6_e2m3"])
def test_fp6_dtypes_keep_their_exponent_mantissa_split(name):
    assert quark_spec({"dtype": name}).format.name == name


def test_e4m3_block_scales_are_fp8_e4m3_on_the_last_axis():
    """NVFP4-style: ``scale_format`` e4m3 gives fp8_e4m3 block scales; no ch_axis: last."""
    spec = quark_spec({"dtype": "fp4", "qscheme": "per_group", "group_size": 16,
                       "scale_format": "e4m3"})
    assert spec.layout == Block(16, -1) and _scale(spec) == "fp8_e4m3"


def test_a_block_scale_format_without_a_group_size_is_refused():
    with pytest.raises(ValueError, match="group_size"):
        quark_spec({"dtype": "fp4", "qscheme": "per_group", "scale_format": "e8m0"})


@pytest.mark.parametrize("dtype", ["fp4", "fp6_e2m3", "fp6_e3m2"])
@pytest.mark.parametrize("qscheme", ["per_tensor", "per_channel"])
def test_fp4_scale_formats_price_fp4_and_fp6_with_float32_scales(dtype, qscheme):
    """``fp4_scale_formats``: fp4 / fp6 per tensor / channel take an e8m0 scale_format as a
    float32-scaled spec; without it such a qspec is refused (block scales need per_group)."""
    q = {"dtype": dtype, "qscheme": qscheme, "ch_axis": 0, "scale_format": "e8m0"}
    spec = quark_spec(q, fp4_scale_formats=True)
    assert spec.layout == (Tensor() if qscheme == "per_tensor" else Channel(0))
    assert _scale(spec) == "fp32"
    with pytest.raises(ValueError, match="per_group"):
        quark_spec(q)


def test_uniform_integer_and_per_tensor_fp8_ignore_scale_format():
    """``uniform``: an integer dtype, and fp8 per tensor / channel, take float32 scales
    whatever ``scale_format`` says; fp8 per_group keeps its block scale."""
    int8 = quark_spec({"dtype": "int8", "qscheme": "per_group", "group_size": 32,
                       "scale_format": "e8m0"}, uniform=True)
    assert int8.layout == Group(32, -1) and _scale(int8) == "fp32"
    fp8 = quark_spec({"dtype": "fp8_e4m3", "scale_format": "e8m0"}, uniform=True)
    assert fp8.layout == Tensor() and _scale(fp8) == "fp32"
    grouped = quark_spec({"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 32,
                          "scale_format": "e8m0"}, uniform=True)
    assert grouped.layout == Block(32, -1) and _scale(grouped).startswith("e8m0")


def test_pad_blocks_gives_a_padding_block_layout_for_per_group():
    q = {"dtype": "int4", "qscheme": "per_group", "group_size": 32}
    assert isinstance(quark_spec(q).layout, Group)
    assert isinstance(quark_spec(q, pad_blocks=True).layout, Block)


def test_the_qspecs_qscheme_wins_over_the_class_default():
    """``qscheme``: the one of a qspec *without* one."""
    q = {"dtype": "int8", "qscheme": "per_tensor"}
    assert quark_spec(q, qscheme="per_channel").layout == Tensor()
    assert quark_spec({"dtype": "int8", "ch_axis": 0}, qscheme="per_channel").layout \
        == Channel(0)


def test_the_class_dtype_wins_over_the_qspecs():
    """``dtype``: the one a class prices whatever the qspec's is (PerBlockBFPObserver)."""
    spec = quark_spec({"dtype": "int8", "group_size": 8}, dtype="bfp16")
    assert spec.format.name == "int8_narrow" and spec.layout == Block(8, -1)


def test_float_formats_are_symmetric_whatever_the_qspec_says():
    assert quark_spec({"dtype": "fp8_e4m3", "symmetric": False}).symmetric is True
    assert quark_spec({"dtype": "uint8", "symmetric": False}).symmetric is False


def test_round_method_8_is_quarks_half_even():
    """Quark's ``RoundType.half_even`` has the value 8: taken as a plain int too."""
    assert quark_spec({"dtype": "int8", "round_method": 8}).format.name == "int8"


def test_int2_is_a_two_bit_signed_range():
    fmt = quark_spec({"dtype": "int2"}).format
    assert (fmt.qmin, fmt.qmax) == (-2, 1)
    assert quark_qmin_qmax("int2") == (-2, 1)


@pytest.mark.parametrize(("dtype", "expected", "kind"), [
    ("fp8_e5m2", (-57344, 57344), int),
    ("fp8_e4m3", (-448, 448), int),
    ("fp4", (-6.0, 6.0), float),
    ("fp6_e2m3", (-7.5, 7.5), float),
    ("fp6_e3m2", (-28.0, 28.0), float),
    ("uint4", (0, 15), int),
])
def test_quark_qmin_qmax_types_and_values(dtype, expected, kind):
    """Ints for the integer and fp8 e4m3 / e5m2 dtypes, floats for the others."""
    got = quark_qmin_qmax(dtype)
    assert got == expected and all(type(v) is kind for v in got)


def test_quark_qmin_qmax_of_e5m3_is_unsigned_from_zero_and_of_casts_their_finfo():
    """"floats for the others (unsigned E5M3 from 0)"; a cast's range is its dtype's."""
    lo, hi = quark_qmin_qmax("fp8_e5m3")
    assert lo == 0.0 and type(lo) is float and hi > 0
    info = torch.finfo(torch.bfloat16)
    assert quark_qmin_qmax("bfloat16") == (info.min, info.max)


def test_quark_qmin_qmax_is_none_for_block_dtypes():
    assert quark_qmin_qmax("mx") == (None, None) == quark_qmin_qmax("bfp16")


def test_pro_takes_uint4_and_refuses_int4():
    """"only supports 4bit and 8bit": uint4 (torch.ao's quint4x2), int8, uint8."""
    obs = quark.PerTensorHistogramObserverPro({"dtype": "uint4", "symmetric": False})
    assert (obs.quant_min, obs.quant_max) == (0, 15)
    with pytest.raises(ValueError, match="4bit and 8bit"):
        quark.PerTensorHistogramObserverPro({"dtype": "int4"})


@pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")
@pytest.mark.parametrize(("dtype", "lo", "hi"), [("int8", -64, 63), ("uint8", 0, 127)])
def test_pro_reduce_range_halves_the_code_range(dtype, lo, hi):
    """torch.ao's reduce_range: qint8 -64..63, quint8 0..127."""
    obs = quark.PerTensorHistogramObserverPro({"dtype": dtype, "symmetric": False},
                                              reduce_range=True)
    assert (obs.spec.quant_min, obs.spec.quant_max) == (lo, hi)
    obs(torch.linspace(-3.0, 5.0, 64))
    _, zp = obs.calculate_qparams()
    assert lo <= int(zp) <= hi
