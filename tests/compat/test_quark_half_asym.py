"""compat.quark's asymmetric integer qparams against AMD Quark 0.13 on bfloat16 / float16
ranges: Quark's ``calculate_int_quant_params`` runs its ops in the range's dtype, so it
rounds ``max - min`` there before dividing by ``qmax - qmin`` (the scale a last bit off
where quantscope rounded once) and divides the zero point by that scale in the dtype torch
promotes the two to (bfloat16 per channel / group: a code off). Symmetric and float32 ranges
stay as they were (one rounding gives Quark's there).

Every test imports Quark and compares with its own classes (the peers' venv).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]
pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it

from quark_twins import quark_twins

LAYOUTS = [
    ("PerTensorMinMaxObserver", {}),
    ("PerChannelMinMaxObserver", {"qscheme": "per_channel", "ch_axis": 0}),
    ("PerGroupMinMaxObserver", {"qscheme": "per_group", "ch_axis": -1, "group_size": 16}),
]
HALF = [torch.bfloat16, torch.float16]


def batch(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(16, 64, generator=g) * 3 + 0.5).to(dtype)


def same(theirs, ours):
    """Bitwise equal ``(scale, zero_point)`` pairs, dtypes and shapes too."""
    for a, b in zip(theirs, ours, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a, b), (a, b)


def check_batches(name, extra, x_dtype, seeds=range(12), cast=None, **kw):
    """Quark's class and ours agree on each batch: ``_calculate_qparams()`` and
    ``calculate_qparams(min_val, max_val)`` of the observed range (after ``cast``, if any)."""
    for seed in seeds:
        theirs, ours = quark_twins(name, **kw, **extra)
        for o in (theirs, ours):
            o(batch(seed, x_dtype))
            if cast:
                getattr(o, cast)()
        same(theirs._calculate_qparams(), ours._calculate_qparams())
        same(theirs.calculate_qparams(theirs.min_val, theirs.max_val),
             ours.calculate_qparams(ours.min_val, ours.max_val))


@pytest.mark.parametrize("name, extra", LAYOUTS)
@pytest.mark.parametrize("dtype", ["uint8", "int8", "uint4"])
@pytest.mark.parametrize("x_dtype", HALF)
@pytest.mark.parametrize("scale_type", ["float", "float32"])
def test_asymmetric_half_range_rounds_width_as_quark(name, extra, dtype, x_dtype, scale_type):
    """Found by probing: about 1/3 of per-tensor batches (every per-channel / per-group
    one) had a scale a last bit off, or a zero point a code off."""
    check_batches(name, extra, x_dtype, dtype=dtype, symmetric=False, scale_type=scale_type)


@pytest.mark.parametrize("name, extra", LAYOUTS)
@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_asymmetric_after_a_module_cast_as_quark(name, extra, cast):
    """A cast eps (0-dim) makes the per-tensor scale, and so the zero point's division,
    the cast's dtype instead of float32: both as Quark's."""
    x_dtype = torch.bfloat16 if cast == "bfloat16" else torch.float16
    check_batches(name, extra, x_dtype, seeds=range(8), cast=cast, dtype="uint8",
                  symmetric=False)


@pytest.mark.parametrize("name, extra", LAYOUTS)
@pytest.mark.parametrize("symmetric, x_dtype", [(True, torch.bfloat16), (True, torch.float16),
                                                (True, torch.float32),
                                                (False, torch.float32)])
def test_symmetric_and_float32_ranges_unchanged(name, extra, symmetric, x_dtype):
    """One rounding of the float32 quotient is Quark's half division: these stay exact."""
    check_batches(name, extra, x_dtype, seeds=range(6), dtype="int8", symmetric=symmetric)


@pytest.mark.parametrize("x_dtype", HALF)
def test_given_half_range_priced_as_quark(x_dtype):
    """``calculate_qparams(min_val, max_val)`` of a 1-dim half range given directly (no
    data): the scale in its dtype and the zero point divided there, as Quark's."""
    g = torch.Generator().manual_seed(3)
    lo = (-torch.rand(32, generator=g) * 5).to(x_dtype)
    hi = (torch.rand(32, generator=g) * 7).to(x_dtype)
    theirs, ours = quark_twins("PerChannelMinMaxObserver", dtype="uint8", symmetric=False,
                               qscheme="per_channel", ch_axis=0)
    same(theirs.calculate_qparams(lo, hi), ours.calculate_qparams(lo, hi))


def test_float16_width_overflow_keeps_the_native_finite_scale():
    """A float16 range wider than 65504: Quark's ``max - min`` overflows (an inf scale, zero
    point qmin); quantscope keeps the native finite scale (documented difference)."""
    theirs, ours = quark_twins("PerTensorMinMaxObserver", dtype="uint8", symmetric=False)
    x = torch.tensor([-40000.0, 40000.0], dtype=torch.float16)
    theirs(x)
    ours(x)
    assert torch.isinf(theirs._calculate_qparams()[0])
    scale, zp = ours._calculate_qparams()
    assert scale.dtype == torch.float32 and torch.isfinite(scale) and int(zp) == 127
