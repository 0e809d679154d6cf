"""The weighted (imatrix) search on ranges near float32's max, and on non-finite weights.

``weighted_search``'s incumbent is the min-max range times ``expand``; where that leaves
float32 every candidate (a shrink of it) is infinite too, and the search returned an
infinite range silently. ``imatrix_range`` returned NaN / inf ranges for a weight holding
NaN / inf. Both now raise, naming the function and the argument.
"""

from __future__ import annotations

import pytest
import torch

from quantscope import QuantSpec
from quantscope.compat.llmcompressor_base import check_expanded_range
from quantscope.estimators.weighted import imatrix_range, weighted_search

F = torch.finfo(torch.float32).max
SPEC = QuantSpec("int8", "channel:0")


def _units(big):
    return torch.tensor([[big, -1.0, 2.0, 5.0], [1.0, 2.0, 3.0, -4.0]])


@pytest.mark.parametrize("float32_sums", [False, True])
def test_expand_past_float32_raises(float32_sums):
    with pytest.raises(ValueError, match=r"weighted_search: expand=2\.0 .* float32's max "
                                         r"\(max \|x\| = 3e\+38\)"):
        weighted_search(_units(3e38), None, SPEC, expand=2.0, float32_sums=float32_sums)


@pytest.mark.parametrize("float32_sums", [False, True])
def test_expand_that_stays_finite_is_searched(float32_sums):
    # 1e38 x 2 = 2e38 < F: a finite range comes back, the incumbent's or a shrink of it
    lo, hi = weighted_search(_units(1e38), None, SPEC, expand=2.0, float32_sums=float32_sums)
    assert bool(torch.isfinite(torch.stack((lo, hi))).all())
    assert float(hi[0]) <= 2e38 and float(lo[1]) >= -8.0


def test_expand_one_at_float32_max_is_searched():
    lo, hi = weighted_search(_units(F), None, SPEC)
    assert torch.equal(hi[0], torch.tensor(F)) and bool(torch.isfinite(lo).all())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_imatrix_range_refuses_non_finite_weights(bad):
    w = _units(1.0)
    w[1, 2] = bad
    with pytest.raises(ValueError, match=r"imatrix_range: w must be finite"):
        imatrix_range(w, torch.ones(4), SPEC)


def test_compat_check_names_the_largest_finite_end():
    lo, hi = torch.tensor([-3e38, -1.0, float("-inf")]), torch.tensor([1.0, 2e38, 0.0])
    with pytest.raises(ValueError, match=r"expand=1\.5 .* \(max \|x\| = 3e\+38\)"):
        check_expanded_range(type("Obs", (), {"base_name": "weight"})(), lo, hi, 1.5)
    check_expanded_range(None, lo, hi, 1.0)  # expand 1: nothing to refuse, nothing read


def test_float64_units_expanded_past_float32_raise():
    """s48 review: the rule was tested in the ranges' own dtype, so float64 units near
    float32's max came back expanded to 5.4e38 (finite in float64, past every float32
    scale)."""
    with pytest.raises(ValueError, match=r"expand=1\.8 .* float32's max \(max \|x\| = 3e\+38\)"):
        weighted_search(_units(3e38).double(), None, SPEC, expand=1.8)
    lo, hi = weighted_search(_units(1e38).double(), None, SPEC, expand=1.8)
    assert float(hi[0]) <= 1.8e38 and bool(torch.isfinite(torch.stack((lo, hi))).all())


def test_compat_half_statistics_name_their_own_dtype():
    # llm-compressor keeps fp16 data's statistics in fp16 and expands them there
    lo, hi = torch.tensor([-1.0], dtype=torch.half), torch.tensor([40000.0], dtype=torch.half)
    with pytest.raises(ValueError, match=r"past float16's max \(max \|x\| = 4e\+04\)"):
        check_expanded_range(type("Obs", (), {"base_name": "weight"})(), lo, hi, 1.8)
    check_expanded_range(None, lo.float(), hi.float(), 1.8)  # finite in float32
