"""compat.quark's histogram estimators against AMD Quark 0.13 after a module cast
(``.half()`` / ``.bfloat16()`` / ``.double()``): Quark's first batch bins in new float32 edges
(a cast before data converts only its eps buffer), a cast after data converts the edges and
counts its search then runs in. Scale and zero point values and dtypes, bit for bit. Runs in
the peers' venv."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from tiers import each_value

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]

pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it
from quark_twins import quark_twins

ESTIMATORS = ["PerTensorPercentileObserver", "PerTensorMSEObserver"]
#: (dtype, symmetric): the cases of the report, fp8 and int8 both ways
QSPECS = [("uint8", False), ("int8", False), ("int8", True), ("fp8_e4m3", True)]
INPUTS = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # Quark's loggers
    yield
    logging.disable(logging.NOTSET)


def batches(widen: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(16, 64, generator=g) * 3 + 0.5]
    return [*xs, torch.randn(16, 64, generator=g) * 5] if widen else xs


def same_qparams(theirs, ours) -> None:
    for a, b in zip(theirs._calculate_qparams(), ours._calculate_qparams(), strict=True):
        assert (b.dtype, b.shape) == (a.dtype, a.shape), (a, b)
        assert torch.equal(a, b), (a, b)


def calibrate(name, dtype, symmetric, cast, when, x_dtype, widen):
    theirs, ours = quark_twins(name, dtype=dtype, symmetric=symmetric)
    for obs in (theirs, ours):
        if when == "before":
            getattr(obs, cast)()
        for x in batches(widen):
            obs(x.to(x_dtype))
        if when == "after":
            getattr(obs, cast)()
    return theirs, ours


# every cast with every input dtype in make test, the rest of the product extended
@pytest.mark.parametrize(("name", "dtype", "symmetric", "cast", "x_dtype", "widen"),
                         each_value(ESTIMATORS, QSPECS,
                                    list(itertools.product(["half", "bfloat16", "double"],
                                                           INPUTS)),
                                    [False, True]))
def test_cast_before_data_keeps_float32_grid(name, dtype, symmetric, cast, x_dtype, widen):
    """The reported case (``obs.half()`` then float16 batches): Quark's scale is float32
    (its float32 search, clamped by the cast eps), not the cast's dtype; after ``.double()``
    float64 for integer scales, float32 for fp8 (its eps follows the int64 zero)."""
    theirs, ours = calibrate(name, dtype, symmetric, cast, "before", x_dtype, widen)
    assert ours.calib_bin_edges.dtype == theirs.calib_bin_edges.dtype == torch.float32
    same_qparams(theirs, ours)


@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize(("dtype", "symmetric"), QSPECS)
@pytest.mark.parametrize("name", ESTIMATORS)
def test_half_cast_after_data_searches_in_half(name, dtype, symmetric, x_dtype):
    """A cast after data converts Quark's edges and counts: its search runs in float16."""
    theirs, ours = calibrate(name, dtype, symmetric, "half", "after", x_dtype, False)
    assert ours.calib_hist.dtype == theirs.calib_hist.dtype == torch.float16
    assert torch.equal(ours.calib_bin_edges, theirs.calib_bin_edges)
    same_qparams(theirs, ours)


@pytest.mark.parametrize(("dtype", "symmetric"), QSPECS)
def test_bfloat16_cast_after_data_mse(dtype, symmetric):
    theirs, ours = calibrate("PerTensorMSEObserver", dtype, symmetric, "bfloat16", "after",
                             torch.float32, True)
    same_qparams(theirs, ours)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_cast_then_float_before_data(name):
    """``.half()`` then ``.float()`` before data: as no cast (float32 eps again)."""
    theirs, ours = quark_twins(name, dtype="uint8", symmetric=False)
    for obs in (theirs, ours):
        obs.half().float()
        obs(batches(False)[0].half())
    same_qparams(theirs, ours)
