"""A FloatFormat's ``max`` is one of its (ebits, mbits) values, so round returns only values
the format holds; NVFP4's global scale where ``448 * 6 / amax`` overflows float32."""

import itertools

import pytest
import torch

from quantscope import presets
from quantscope.compat.quark_scales import FP8_E5M3
from quantscope.formats import FORMATS, FloatFormat, get_format
from quantscope.qdq import fake_quantize
from quantscope.qparams import qparams_from_range
from quantscope.scales import nvfp4_global_scale

SHAPES = [(1, 2), (2, 1), (2, 3), (3, 2), (3, 0), (4, 3), (5, 2), (5, 3)]


def every_code(ebits: int, mbits: int) -> list[float]:
    """Every non-negative value of the bit fields, each code finite (no NaN / inf reserved):
    exponent field 0 is subnormal, ``0.m * 2 ** (1 - bias)``."""
    bias = 2 ** (ebits - 1) - 1
    return sorted({((e > 0) + m / 2**mbits) * 2.0 ** (max(e, 1) - bias)
                   for e in range(2**ebits) for m in range(2**mbits)})


# probing: e4m3 with max 300 rounded 299 / 1000 to 288 / 300 (300 is no e4m3 value); e2m1
# with max 100 rounded 7 / 50 to 8 / 48 (e2m1 ends at 6); the dict path rounded 5.2 to 5
@pytest.mark.parametrize("make, match", [
    (lambda: FloatFormat("cap300", 4, 3, 300.0),
     r"'cap300': max=300\.0 is not a value of e4m3 .*neighbours are 288\.0 and 320\.0.*480"),
    (lambda: FloatFormat("e2m1_100", 2, 1, 100.0),
     r"'e2m1_100': max=100\.0 is past the largest finite value e2m1 .* 6\.0"),
    (lambda: get_format({"name": "x", "ebits": 2, "mbits": 1, "max": 5.0}),
     r"'x': max=5\.0 is not a value of e2m1 .*neighbours are 4\.0 and 6\.0"),
], ids=["e4m3_300", "e2m1_100", "dict_e2m1_5"])
def test_a_max_the_format_cannot_hold_raises(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("ebits, mbits", SHAPES)
def test_every_value_is_a_max_and_round_stays_on_the_table(ebits, mbits):
    """Each value is accepted as max (a format reserving its top codes, as e4m3fn's 448 <
    480, included) and round gives table values up to it; a midpoint between two values, or
    a value past the top code, raises."""
    table = every_code(ebits, mbits)
    held = torch.tensor(table)
    x = torch.cat([held, (held[1:] + held[:-1]) / 2, held * 3, torch.tensor([1e30])])
    x = torch.cat([x, -x])
    for v in table[1:]:
        got = FloatFormat("f", ebits, mbits, v).round(x).abs()
        assert got.max().item() == v and torch.isin(got, held).all(), v
    for bad in [(a + b) / 2 for a, b in itertools.pairwise(table)] + [table[-1] * 2]:
        with pytest.raises(ValueError, match="max="):
            FloatFormat("f", ebits, mbits, bad)


def test_the_existing_formats_stay_valid():
    """The built-ins, Quark's e5m3 and the customs the suite builds (fnuz e4m3 240, e3m2 24,
    e8m0 at 2 ** 127, the top binade float32 holds)."""
    for f in [*FORMATS.values(), FP8_E5M3]:
        if f.is_float:
            assert FloatFormat(f.name, f.ebits, f.mbits, f.max, f.torch_dtype) == f
    FloatFormat("fp8_e4m3", 4, 3, 240.0, torch.float8_e4m3fnuz)
    FloatFormat("fp6_e3m2_nosat", 3, 2, 24.0)
    FloatFormat("e8m0", 8, 0, 2.0 ** 127)
    with pytest.raises(ValueError, match="past the largest finite value e8m0"):
        FloatFormat("e8m0", 8, 0, torch.finfo(torch.float32).max)


def test_nvfp4_global_scale_is_1_where_the_quotient_overflows():
    """amax 1e-37 < 448 * 6 / float32 max: global scale 1, as compressed-tensors'
    generate_gparam; the tensor then quantizes to 0. Just above the bound it is finite."""
    ct = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
    spec = presets.NVFP4
    for amax in (1e-37, 7.8e-36):
        a = torch.tensor(amax)
        gs = nvfp4_global_scale(a, spec.format)
        assert gs.item() == 1.0
        assert torch.equal(gs.reshape(1), ct.generate_gparam(-a, a).reshape(1))
        x = torch.linspace(-amax, amax, 64).reshape(2, 32)
        u = spec.layout.to_units(x)
        qp = qparams_from_range(u.amin(-1), u.amax(-1), spec)
        assert qp.global_scale.item() == 1.0
        assert fake_quantize(x, qp, spec).eq(0).all()
    a = torch.tensor(8e-36)
    gs = nvfp4_global_scale(a, spec.format)
    assert torch.isfinite(gs) and gs.item() > 1e38
    assert torch.equal(gs.reshape(1), ct.generate_gparam(-a, a).reshape(1))
