"""Pins from a mutation round over ``estimators/scorer.py`` (a :class:`Line`'s candidates,
the strides of ``line_argmin``'s rounds, its refusals, ``tensor_amax``) and
``estimators/weighted.py`` (the weighted search's refusals, importance as per-element
weights, the output error's weights, reference and token shapes): each test fails on a small
defect of those files that no earlier test caught. Expected values come from the docstrings'
definitions (a line's ``t_k``, the rounds' strides, ``sum_o c_o ||ref - Q(x) w^T||_o^2``),
written out here on small tensors."""

from __future__ import annotations

import pytest
import torch
from test_search_reference_s60 import qdq

from quantscope.estimators.scorer import (
    MOVE_HI,
    MOVE_LO,
    HistogramScorer,
    Line,
    _levels,
    _line_pick,
    tensor_amax,
)
from quantscope.estimators.weighted import (
    imatrix_range,
    importance_units,
    output_clip_range,
    output_error,
    weighted_search,
)
from quantscope.layout import Channel
from quantscope.presets import NVFP4
from quantscope.spec import QuantSpec
from quantscope.stats.histogram import Hist

INT8 = QuantSpec("int8", "tensor")


def _zero_hist(units=1, bins=16):
    """A histogram with no values: every candidate's error is 0."""
    return Hist(torch.zeros(units, bins, dtype=torch.int64), torch.zeros(units),
                torch.ones(units), absolute=True)


@pytest.mark.parametrize("side,want_lo,want_hi", [
    (MOVE_HI, [-1.0] * 9, [1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0]),
    # lo moved past hi: each candidate ordered, (min, max)
    (MOVE_LO, [-2.0, -1.75, -1.5, -1.25, -1.0, -0.75, -0.5, -0.25, 0.0],
     [2.0] * 9),
])
def test_a_move_line_runs_from_minus_to_plus_radius_in_steps(side, want_lo, want_hi):
    """``Line.move``: ``d`` from ``-radius`` to ``radius`` bin widths in ``1 / steps``, the
    middle candidate (``radius * steps``) no move."""
    line = Line.move(torch.tensor([-1.0]), torch.tensor([2.0]), torch.tensor([0.5]), side,
                     radius=2, steps=2)
    lo, hi = line.ranges()
    assert line.n == 9
    assert torch.equal(lo, torch.tensor([want_lo])) and torch.equal(hi, torch.tensor([want_hi]))


def test_a_lines_offsets_divide_before_they_scale_by_the_width():
    """``t_k = float32(k * mul + add) / div * width`` in float32, in that order: with
    thirds of widths that are no powers of two, dividing last would round differently."""
    width = torch.tensor([0.1, 0.3, 0.7])
    line = Line.move(torch.tensor([-1.0, -2.0, -3.0]), torch.zeros(3), width, MOVE_HI,
                     radius=2, steps=3)
    want = torch.stack([torch.tensor(float(k - 6)) / 3 * width for k in range(13)], dim=1)
    assert torch.equal(line.ranges()[1], want)


@pytest.mark.parametrize("coarse,want", [(2, (2, 1)), (1, (1,)), ((3, 2, 1), (3, 2, 1))])
def test_an_int_coarse_k_means_strides_k_then_1(coarse, want):
    assert _levels(coarse) == want


def _pick(err, mid, coarse):
    idx, e = _line_pick(torch.tensor([err], dtype=torch.float64), mid, _levels(coarse))
    return int(idx[0]), float(e[0])


def test_a_finer_round_looks_strictly_within_the_previous_stride():
    """Strides (3, 2, 1) from ``mid = 0``: 0, 3, 6 give 3; stride 2 within 3 of it gives 5;
    stride 1 within 2 of 5 scores 4..6 only (7, at distance 2, is not looked at)."""
    err = [9.0, 9.0, 9.0, 5.0, 9.0, 4.0, 9.0, 0.0, 9.0]
    assert _pick(err, 0, (3, 2, 1)) == (5, 4.0)


def test_line_argmin_refuses_mid_past_the_line():
    scorer = HistogramScorer(_zero_hist(), INT8)
    line = Line.centres(torch.tensor([1 / 16]), 0, 1, 16)
    with pytest.raises(ValueError, match=r"0 <= mid < 16, .*mid=16"):
        scorer.line_argmin(line, 16, torch_only=True)


def test_candidates_for_another_number_of_units_are_refused():
    counts = torch.ones(2, 8, dtype=torch.int64)
    scorer = HistogramScorer(Hist(counts, -torch.ones(2), torch.ones(2)), INT8)
    with pytest.raises(ValueError, match=r"with 2 units, got \(1, 3\) and \(1, 3\)"):
        scorer(-torch.ones(1, 3), torch.ones(1, 3), torch_only=True)


def test_tensor_amax_is_none_for_a_spec_without_a_global_scale():
    """Only a global-scale spec (NVFP4) gets the tensor-wide ``max |x|`` of the units' ends."""
    lo, hi = torch.tensor([-3.0, -1.0]), torch.tensor([2.0, 1.0])
    assert tensor_amax(INT8, lo, hi) is None
    assert float(tensor_amax(NVFP4, lo, hi)) == 3.0


# ------------------------------------------------------------------ weighted.py
INT4 = QuantSpec("int4", Channel(0))


def _units(seed=0):
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kwargs,match", [
    ({"factors": []}, r"factors must be in \[0, 1\], got \[\]"),
    ({"weights": torch.ones(32, 4)}, r"weights must be None or a tensor of units' shape \(4, 32"),
    # refused by the search itself, before any pricing (float32 sums price in torch)
    ({"norm": 0, "float32_sums": True}, r"imatrix_range: norm must be a finite number in \(0"),
])
def test_weighted_search_refuses_no_factors_weights_of_another_shape_and_norm_0(kwargs, match):
    u = _units()
    kwargs = {"weights": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        weighted_search(u, kwargs.pop("weights"), INT4, **kwargs)


def test_importance_is_one_value_per_input_channel():
    with pytest.raises(ValueError, match=r"one value per input channel \(3\), got 1"):
        importance_units(torch.tensor([2.0]), (2, 3), INT4)


def test_imatrix_refuses_a_weight_that_is_not_2d():
    with pytest.raises(ValueError, match=r"w must be a 2-D weight \[out, in\], got "
                                         r"torch.Size\(\[16\]\)"):
        imatrix_range(torch.randn(16), None, INT4)


def _x_w(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 8, generator=g), torch.randn(3, 8, generator=g)


def test_output_error_weights_each_output_feature_and_matches_the_reference_given():
    x, w = _x_w()
    spec = QuantSpec("int8", "tensor")
    lo, hi = torch.tensor([-1.0]), torch.tensor([1.0])
    plain = output_error(x, w, spec, lo, hi)
    assert output_error(x, w, spec, lo, hi, out_weights=torch.full((3,), 2.0)) == 2 * plain
    one = output_error(x, w, spec, lo, hi, out_weights=torch.tensor([0.0, 1.0, 0.0]))
    assert one == pytest.approx(output_error(x, w[1:2], spec, lo, hi), rel=1e-6)
    # against another reference: ||Q(x) w^T - 0||^2
    qx = qdq(x.double(), lo, hi, spec).float()
    want = float((qx @ w.T).square().double().sum())
    got = output_error(x, w, spec, lo, hi, reference=torch.zeros(64, 3))
    assert got == pytest.approx(want, rel=1e-6)


def test_output_clip_range_takes_tokens_of_any_leading_shape_and_checks_w_q():
    x, w = _x_w(1)
    spec = QuantSpec("int8", "tensor")
    cands = [(torch.tensor([-a]), torch.tensor([a])) for a in (3.0, 1.0)]
    flat = output_clip_range(x, w, spec, cands)
    assert output_clip_range(x.reshape(4, 16, 8), w, spec, cands)[3] == flat[3]
    with pytest.raises(ValueError, match=r"w_q must be \[out, 8\], got \(3, 7\)"):
        output_clip_range(x, w[:, :7], spec, cands)
