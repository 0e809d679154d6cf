"""compat.quark's PerBlockMXObserver refuses integer MX elements, as Quark 0.13's own
``PerBlockMXObserver`` asserts (fp4 / fp6 / fp8 elements only); the native MXINT8 keeps its
'even' rule (6 fraction bits, OCP MXINT8's 1.6 layout). Quark's side: test_quark_exact.py."""

from __future__ import annotations

import pytest
import torch

from quantscope import fake_quantize, get_observer, presets
from quantscope.compat import quark
from quantscope.formats import get_format
from quantscope.scales import e8m0_scale

INT_MX = [
    {"dtype": "mx", "mx_element_dtype": "int8"},  # Quark's MXINT8
    {"dtype": "int8", "scale_format": "e8m0"},  # the same through an e8m0 scale_format
    {"dtype": "int4", "scale_format": "e8m0"},
    {"dtype": "bfp16"},  # PerBlockBFPObserver's dtype
]


def qspec(**kw):
    return {"qscheme": "per_group", "group_size": 32, "ch_axis": -1, "symmetric": True,
            "scale_calculation_mode": "even", "is_dynamic": False, **kw}


# probing: the compat class took an int8 element Quark's own observer refuses, and gave
# quantscope's scales under Quark's name (they differ from Quark's fake_quantize_mx)
@pytest.mark.parametrize("kw", INT_MX, ids=lambda kw: kw["dtype"])
def test_per_block_mx_observer_refuses_integer_elements_as_quark(kw):
    for err in (AssertionError, ValueError):  # Quark's type, and quantscope's bad argument
        with pytest.raises(err, match=r"PerBlockMXObserver: Quark's PerBlockMXObserver takes "
                                      r"float elements only .*got int"):
            quark.PerBlockMXObserver(qspec(**kw))
    with pytest.raises(quark.UnsupportedElementError, match=r"MXINT8 runs natively"):
        get_observer("quark:PerBlockMXObserver", qspec=qspec(**kw))


@pytest.mark.parametrize("element", ["fp4", "fp8_e4m3", "fp6_e2m3"])
def test_per_block_mx_observer_keeps_float_elements(element):
    obs = quark.PerBlockMXObserver(qspec(dtype="mx", mx_element_dtype=element))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    obs(x)
    fmt = get_format({"fp4": "fp4_e2m1"}.get(element, element))
    amax = x.reshape(4, 2, 32).abs().amax(-1)
    assert torch.equal(obs.calculate_qparams()[0], e8m0_scale(amax, fmt, "even"))


def test_native_mxint8_even_rounds_the_block_max_to_6_fraction_bits():
    """quantscope's own rule, unchanged: 1 + 127/128 rounds (half up) to 2 on 6 fraction bits,
    so the exponent moves up (scale 2 ** (1 - 6)); 1 + 1/64 keeps 2 ** (0 - 6)."""
    spec = presets.MXINT8.replace(scale="e8m0:even")
    amax = torch.tensor([1 + 127 / 128, 1 + 1 / 64, 1 + 31 / 64])
    assert e8m0_scale(amax, spec.format, "even").tolist() == [2.0 ** -5, 2.0 ** -6, 2.0 ** -6]
    x = torch.zeros(3, 32)
    x[:, 0] = amax
    q = get_observer("memoryless_minmax", spec)
    q(x)
    # codes are amax / scale rounded half to even: 63.5 -> 64 (2.0), 65, 95
    assert fake_quantize(x, q.calculate_qparams(), spec)[:, 0].tolist() == [2.0, 65 / 64, 95 / 64]
