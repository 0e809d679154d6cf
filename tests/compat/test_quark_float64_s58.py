"""compat.quark's integer scales of a float64 range against AMD Quark 0.13: Quark's formula
divides in float64 (float64 input, or a ``.double()`` after data), where quantscope divided in
float32 and cast (other last bits); and a percentile observer's all-zero batches after a module
cast price Quark's float32 ``zeros(1)`` range, not one in the cast's dtype. Values, dtypes and
shapes bit for bit. Runs in the peers' venv."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]

pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it
from quark_twins import quark_twins

CLASSES = {
    "PerTensorMinMaxObserver": {},
    "PerChannelMinMaxObserver": {"qscheme": "per_channel", "ch_axis": 0},
    "PerGroupMinMaxObserver": {"qscheme": "per_group", "ch_axis": 1, "group_size": 16},
    "PerTensorPercentileObserver": {},
    "PerTensorMSEObserver": {},
}
#: (dtype, symmetric)
QSPECS = [("int8", True), ("int8", False), ("uint8", False), ("int4", True), ("uint4", True)]


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # Quark's loggers
    yield
    logging.disable(logging.NOTSET)


def observe(name, dtype, symmetric, x, cast=None):
    """Quark's observer and ours after ``x``, then ``cast`` (a module cast) if given."""
    pair = quark_twins(name, dtype=dtype, symmetric=symmetric, **CLASSES[name])
    for obs in pair:
        obs(x)
        if cast is not None:
            getattr(obs, cast)()
    return pair


def assert_same_qparams(theirs, ours) -> None:
    for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
        assert (b.dtype, b.shape) == (a.dtype, a.shape), (a, b)
        assert torch.equal(a, b), (a, b)


def data(scale: float, shift: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 64, generator=g, dtype=torch.float64) * scale + shift


@pytest.mark.parametrize(("dtype", "symmetric"), QSPECS)
@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize(("scale", "shift"), [(1.0, 0.3), (1e-9, 0.0)])
def test_float64_input_scales_divide_in_float64(name, dtype, symmetric, scale, shift):
    """float64 batches (the eps clamp in float64 too: a 1e-9 range)."""
    assert_same_qparams(*observe(name, dtype, symmetric, data(scale, shift)))


@pytest.mark.parametrize(("dtype", "symmetric"), QSPECS)
@pytest.mark.parametrize("name", list(CLASSES))
def test_double_cast_after_data_divides_in_float64(name, dtype, symmetric):
    """float32 batches, then ``.double()``: Quark's range, and so its formula, in float64."""
    assert_same_qparams(*observe(name, dtype, symmetric, data(1.0, 0.3).float(), "double"))


@pytest.mark.parametrize(("dtype", "symmetric"), QSPECS[:3])
@pytest.mark.parametrize("cast", ["double", "half", "bfloat16"])
def test_zero_mass_percentile_after_a_cast_prices_float32_zeros(dtype, symmetric, cast):
    """All-zero batches (skipped: no mass): Quark's range is float32 ``zeros(1)`` whatever
    the cast, so its eps scale is float32."""
    theirs, ours = observe("PerTensorPercentileObserver", dtype, symmetric,
                           torch.zeros(8, 64), cast)
    assert ours._calculate_qparams()[0].dtype == torch.float32
    assert_same_qparams(theirs, ours)
