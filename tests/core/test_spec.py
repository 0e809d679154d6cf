"""QuantSpec validation and the presets."""

import json

import pytest
import torch

from quantscope import QuantSpec, presets
from quantscope.compat.quark_base import FP8_E5M3
from quantscope.formats import FP4_E2M1, INT4, INT8, FloatFormat, IntFormat
from quantscope.layout import Block, Channel, Group, Tensor, Token
from quantscope.qparams import qparams_from_range
from quantscope.scales import ScaleEncoding


@pytest.mark.parametrize("kwargs,match", [
    ({"format": "fp4", "symmetric": False}, r"QuantSpec\.symmetric: fp4_e2m1 is a float format"),
    ({"format": "fp8_e4m3", "symmetric": False}, r"QuantSpec\.symmetric"),
    ({"layout": "group:-3"}, "Group: size must be a positive integer"),
    ({"layout": "group:0"}, "Group: size must be a positive integer"),
    ({"format": "int1"}, "format 'int1'.*bits must be an integer from 2 to 16"),
    ({"format": "int17"}, "format 'int17'.*bits"),
    ({"format": "fp5"}, "format: unknown name 'fp5'"),
    ({"format": "fp4", "layout": "group:32", "scale": "e8m0"}, r"QuantSpec\.layout: .*needs a Block"),
    ({"format": "fp4", "layout": "tensor", "scale": "fp8_e4m3"}, r"QuantSpec\.layout"),
    ({"format": "int8", "layout": "block:32", "scale": "fp8_e4m3"}, r"QuantSpec\.format: fp8 block"),
    ({"format": "uint8", "layout": "block:32", "scale": "e8m0"}, r"QuantSpec\.format: block scale"),
    ({"format": "int8", "layout": "block:32", "scale": "e8m0", "symmetric": False},
     r"QuantSpec\.symmetric: block scale"),
    ({"quant_min": -129}, r"QuantSpec\.quant_min/quant_max: need integers with -128 <= quant_min"),
    ({"quant_max": 128}, r"QuantSpec\.quant_min/quant_max"),
    ({"quant_min": 5, "quant_max": 5}, r"quant_min\s+< quant_max"),
    ({"format": "uint4", "quant_min": -1}, r"QuantSpec\.quant_min/quant_max.*uint4"),
    ({"quant_min": -10.5}, r"QuantSpec\.quant_min/quant_max: need integers"),
    ({"format": "fp8", "quant_max": 100}, r"integer formats only"),
    # probing: a range without 0 was accepted and its zero point fell outside it (torch.ao:
    # "Used-specified quantization range must include 0.")
    ({"quant_min": -100, "quant_max": -1},
     r"QuantSpec\.quant_min/quant_max: the code range must include 0 .*\[-100, -1\]"),
    ({"quant_min": 1, "quant_max": 100, "symmetric": False}, r"must include 0"),
    ({"format": "uint8", "quant_min": 1, "symmetric": False}, r"must include 0 .*\[1, 255\]"),
    # probing: an E8M0 block scale sized its exponent for int8's full range (emax 6) and
    # silently clipped every code past a narrower quant_max
    ({"format": "int8", "layout": "block:4", "scale": "e8m0:floor", "quant_min": -64,
      "quant_max": 63}, r"QuantSpec\.quant_min/quant_max: block scale e8m0:floor .*\(emax 6\)"),
    ({"format": "int8_narrow", "layout": "block:32", "scale": "e8m0:even", "quant_max": 100},
     r"block scale e8m0:even .*narrower code range"),
    ({"eps": 0.0}, r"QuantSpec\.eps must be a positive number"),
    ({"eps": -1e-3}, r"QuantSpec\.eps"),
    ({"eps": "small"}, r"QuantSpec\.eps"),
    # probing: 1e39 passed and the fp16 / fp8 scale paths raised a bare RuntimeError; 1e-50
    # is 0 in float32 (a zero scale)
    ({"eps": 1e39}, r"QuantSpec\.eps must be a positive number that float32 holds"),
    ({"eps": 1e-50}, r"QuantSpec\.eps must be a positive number that float32 holds"),
    # probing: E8M0 scales ignored eps; NVFP4 stored a non-e4m3 eps as a block scale (500 >
    # e4m3's max), which an fp8 export then changed
    ({"format": "fp4", "layout": "block:32", "scale": "e8m0", "eps": 0.5},
     r"QuantSpec\.eps: E8M0 block scales \(e8m0:floor\) take no eps"),
    ({"format": "fp4", "layout": "block:16", "scale": "fp8_e4m3", "eps": 0.1},
     r"QuantSpec\.eps: with fp8 block scales .* e4m3 value in \(0, 448\]"),
    ({"format": "fp4", "layout": "block:16", "scale": "fp8_e4m3", "eps": 512.0},
     r"QuantSpec\.eps: with fp8 block scales"),
    # probing: an eps past the encoding's largest scale gave fp16 scales of 65504 < eps and a
    # RuntimeError (overflow) from qparams_from_range under pow2
    ({"scale": "fp16", "eps": 1e5}, r"QuantSpec\.eps: 100000\.0 is above the largest fp16 sc"),
    ({"scale": "fp16", "eps": 1e5}, r"scale \(65504\); no stored scale would be at least eps"),
    ({"scale": "bf16", "eps": 3.4e38}, r"QuantSpec\.eps: .*largest bf16 scale \(3\.38953"),
    ({"scale": "pow2:round", "eps": 3e38}, r"largest pow2:round scale \(1\.7014118e\+38\)"),
    ({"format": {"name": "x", "ebits": 4}}, r"format: a dict describes a FloatFormat"),
    ({"format": {"name": "x", "ebits": 4, "mbits": 3, "max": 240.0, "torch_dtype": "int9"}},
     r"format: torch_dtype must be None or a torch dtype's name"),
    ({"symmetric": 1}, r"QuantSpec\.symmetric must be True or False"),
    ({"scale": "fp64"}, r"scale: unknown kind 'fp64'"),
    ({"scale": "pow2:even"}, r"scale: mode 'even' is not valid for kind 'pow2'"),
    ({"layout": "cube"}, r"layout: unknown 'cube'"),
])
def test_invalid_specs_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantSpec(**kwargs)


def test_axis_out_of_range_is_reported_when_the_layout_meets_a_tensor():
    spec = QuantSpec("int8", Channel(3))
    with pytest.raises(ValueError, match="Channel: axis 3 is out of range"):
        spec.layout.check((4, 8))


def test_defaults_and_normalisation():
    s = QuantSpec()
    assert s.format == INT8 and s.layout == Tensor() and s.symmetric
    assert s.scale == ScaleEncoding("fp32") and s.min_scale == torch.finfo(torch.float32).eps
    assert (s.qmin, s.qmax) == (-128, 127) and not s.is_float
    s = QuantSpec("int8", "channel:1", False, "pow2:floor", 1e-6, -64, 63)
    assert s.layout == Channel(1) and s.scale == ScaleEncoding("pow2", "floor")
    assert (s.qmin, s.qmax, s.min_scale) == (-64, 63, 1e-6)
    assert QuantSpec("fp4", "block:16", scale="fp8_e4m3").min_scale == 0.125
    assert QuantSpec("fp4", "block:16", scale="fp8_e4m3", eps=2 ** -9).min_scale == 2 ** -9
    assert QuantSpec("fp8").is_float and QuantSpec("int4_narrow").qmin == -7


def test_replace_validates_and_dict_round_trip():
    s = presets.INT4_GROUP128_ASYM
    assert s.replace(symmetric=True) == presets.INT4_GROUP128
    with pytest.raises(ValueError, match="QuantSpec.symmetric"):
        presets.NVFP4.replace(symmetric=False)
    for spec in set(presets.PRESETS.values()) | {QuantSpec("int8", "channel:1", False, "pow2",
                                                           1e-6, -64, 63)}:
        assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert str(presets.INT4_GROUP128_ASYM) == "int4 group:128 asym"
    assert str(presets.MXFP4) == "fp4_e2m1 block:32 sym scale=e8m0:floor"


def test_eps_up_to_the_encodings_largest_scale_is_kept():
    for scale, eps in (("fp16", 65504.0), ("bf16", 3.3e38), ("pow2:ceil", 2.0**127)):
        spec = QuantSpec("int8", scale=scale, eps=eps)
        assert qparams_from_range(torch.tensor(-1.0), torch.tensor(1.0), spec).scale >= eps


@pytest.mark.parametrize("fmt", [
    FloatFormat("fp6_e3m2_nosat", 3, 2, 24.0),
    FloatFormat("fp8_e4m3", 4, 3, 240.0, torch.float8_e4m3fnuz),  # a built-in's name, other max
    FloatFormat("fp8", 4, 3, 448.0),  # an alias's name
    FP8_E5M3,  # Quark's unsigned-scale e5m3
], ids=lambda f: f.name)
def test_custom_float_formats_round_trip_through_json(fmt):
    """probing: to_dict wrote only the format's name, which read back as the built-in of that
    name (max 448 for 240) or raised on a custom name."""
    spec = QuantSpec(fmt, "channel")
    d = json.loads(json.dumps(spec.to_dict()))
    assert isinstance(d["format"], dict)
    back = QuantSpec.from_dict(d)
    assert back == spec and back.format.max == fmt.max and back.format.torch_dtype == fmt.torch_dtype


def test_built_in_formats_keep_their_name_in_dicts():
    """Saved specs name their format; a built-in FloatFormat equal to FP8_E4M3 reads as a name."""
    for fmt in ("int8", "uint4", "int5_narrow", "fp8_e4m3", "fp4"):
        assert QuantSpec(fmt).to_dict()["format"] == QuantSpec(fmt).format.name
    same = FloatFormat("fp8_e4m3", 4, 3, 448.0, torch.float8_e4m3fn)
    assert QuantSpec(same).to_dict()["format"] == "fp8_e4m3"
    assert QuantSpec.from_dict({**QuantSpec("fp4").to_dict(), "format": "fp4_e2m1"}).format == FP4_E2M1


def test_presets():
    p = presets
    assert p.INT8_PER_CHANNEL == QuantSpec("int8", Channel(0))
    assert p.INT8_PER_TOKEN.layout == Token() and p.INT8_PER_TENSOR.layout == Tensor()
    assert p.INT4_GROUP128.format == INT4 and p.INT4_GROUP128.layout == Group(128)
    assert not p.INT4_GROUP128_ASYM.symmetric
    assert p.FP8_PER_TENSOR.format.name == "fp8_e4m3" and p.FP8_PER_CHANNEL.layout == Channel(0)
    for spec, name in ((p.MXFP8, "fp8_e4m3"), (p.MXFP6_E2M3, "fp6_e2m3"),
                       (p.MXFP6_E3M2, "fp6_e3m2"), (p.MXFP4, "fp4_e2m1")):
        assert spec.format.name == name and spec.layout == Block(32)
        assert spec.scale == ScaleEncoding("e8m0", "floor")
    assert p.MXINT8.format == IntFormat(8, narrow=True) and p.MXINT8.layout == Block(32)
    assert p.NVFP4.format == FP4_E2M1 and p.NVFP4.layout == Block(16)
    assert p.NVFP4.scale == ScaleEncoding("fp8_e4m3")
    assert p.BFP16.layout == Block(8) and p.BFP16.scale == ScaleEncoding("e8m0", "even")
    assert p.get("MXFP4") is p.MXFP4 and p.get("int4-g128") is p.INT4_GROUP128
    with pytest.raises(ValueError, match="preset: unknown 'int3'"):
        p.get("int3")


def test_specs_and_recipes_are_named_apart_and_old_names_stay():
    import quantscope.calibration as C

    assert presets.SPECS is presets.PRESETS and "nvfp4" in presets.SPECS
    assert C.RECIPES is C.PRESETS and "w8a8" in C.RECIPES
    # the same name may be a spec and a recipe (nvfp4): the table says which it is
    assert isinstance(presets.SPECS["nvfp4"], QuantSpec)
    assert isinstance(C.RECIPES["nvfp4"]("minmax"), C.Rule)


def test_code_ranges_that_hold_0_and_full_block_ranges_stay_accepted():
    # 0 at an end of the range (torch.ao's quint8 reduce_range [0, 127]) is a code
    assert QuantSpec("uint8", symmetric=False, quant_min=0, quant_max=127).qmin == 0
    assert QuantSpec("int8", quant_min=0, quant_max=127).qmax == 127
    # a power-of-two scale is computed from the range (amax / ((qmax - qmin) / 2)): kept
    assert QuantSpec("int8", scale="pow2:ceil", quant_min=-64, quant_max=63).qmax == 63
    # an E8M0 spec given its format's own range is the spec without one
    mx = QuantSpec("int8_narrow", Block(32), scale="e8m0", quant_min=-127, quant_max=127)
    assert (mx.qmin, mx.qmax) == (presets.MXINT8.qmin, presets.MXINT8.qmax)
