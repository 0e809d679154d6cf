"""Behaviours of ``quantscope.estimators.entropy`` that no earlier test pinned, found by a
mutation round (session 70): the option ranges of ``check_options``, the ``pick`` marker of
the torch form, the refusal of a forced kernel that declined, ``copy_zero_bin=False`` on both
backends against TensorRT's loop without the copy, the infinite divergences of a unit with no
data, a one-bin histogram, the exact 0 of proportional ``P`` and ``Q`` (empty groups and
counts changing between groups), the fallbacks of an empty unit and of an all-infinite
smoothed row, per-unit ``stop`` tensors of any integer dtype, and Horizon's window count and
``amax = edges[j * stride + start_bin + smooth // 2]`` for even windows and strides > 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_entropy_reference_s60 import ref_entropy_amax, trt_kl
from test_reference_more_s60 import horizon_kl

from quantscope import kernels
from quantscope.estimators import entropy
from quantscope.estimators.entropy import (
    check_options,
    entropy_amax,
    entropy_divergences,
    horizon_entropy_amax,
)
from quantscope.stats.histogram import Hist

BACKENDS = [None, "torch"]  # None: the C kernel on int64 counts, where built


@pytest.mark.parametrize(("name", "bad", "want"), [
    ("num_bits", 1, r"num_bits must be an integer in \[2, 16\], got 1"),
    ("num_bits", 17, r"num_bits must be an integer in \[2, 16\], got 17"),
    ("stride", 0, r"stride must be an integer in \[1, 2147483647\], got 0"),
    ("smooth", 0, r"smooth must be an integer in \[1, 2147483647\], got 0"),
])
def test_options_outside_their_range_are_refused_naming_them(name, bad, want):
    with pytest.raises(ValueError, match=want):
        check_options(**{name: bad})


def test_option_range_ends_are_accepted():
    """``num_bits`` 2 and 16 (MAX_BITS), ``start_bin`` 0, ``stride`` and ``smooth`` 1."""
    assert check_options(num_bits=2, start_bin=0, stride=1, smooth=1) == (2, 0, 1, 1)
    assert check_options(num_bits=16)[0] == 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_pick_is_minus_two_after_the_torch_form(backend):
    """The torch form picks nothing: ``pick`` is set to -2 (float counts, or forced)."""
    c = torch.zeros(2, 64, dtype=torch.float64 if backend is None else torch.int64)
    c[:, 5:40] = 7
    pick = torch.full((2,), 99, dtype=torch.int64)
    entropy_divergences(c, num_bits=4, start_bin=8, backend=backend, pick=pick)
    assert pick.tolist() == [-2, -2]


@pytest.mark.skipif(not kernels.available("entropy"), reason="no C kernel")
def test_a_forced_kernel_that_declines_is_refused_and_the_default_falls_back(monkeypatch):
    c = torch.zeros(1, 64, dtype=torch.int64)
    c[0, 5:40] = 7
    want, _ = entropy_divergences(c, num_bits=4, start_bin=8, backend="torch")
    monkeypatch.setattr(entropy, "_kernel_divergences", lambda *a: None)
    with pytest.raises(ValueError, match="backend='kernel', but the C kernel declined"):
        entropy_divergences(c, num_bits=4, start_bin=8, backend="kernel")
    pick = torch.empty(1, dtype=torch.int64)
    got, _ = entropy_divergences(c, num_bits=4, start_bin=8, pick=pick)
    assert torch.equal(got, want) and pick.tolist() == [-2]


# bin 0 differs from bin 1 (the copy matters); then groups that are not flat, or a group
# [0, 2) whose second count differs from bin 0's (flat only if bin 0 is copied)
LUMPY = [40, 0, 0, 9, 3, 3, 3, 3, 3, 3, 0, 0, 5, 0, 5, 0, 5, 0, 5, 0, 0, 0, 0, 0]
STEP = [40, 9, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("copy_zero_bin", [True, False])
@pytest.mark.parametrize("counts", [LUMPY, STEP])
def test_copy_zero_bin_false_keeps_bin_zero_on_both_backends(counts, backend, copy_zero_bin):
    """TensorRT's loop on the counts as given (``h[0] = h[1]`` only when asked)."""
    c = torch.tensor([counts])
    b = c[0].double().numpy().copy()
    if copy_zero_bin:
        b[0] = b[1]
    kl, cand = entropy_divergences(c, num_bits=2, start_bin=1, copy_zero_bin=copy_zero_bin,
                                   backend=backend)
    ref = torch.tensor([trt_kl(b, int(i), 2) for i in cand], dtype=torch.float64)
    assert torch.equal(torch.isinf(kl[0]), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(kl[0, fin], ref[fin], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_unit_with_no_data_is_infinite_at_every_threshold(backend):
    c = torch.zeros(2, 32, dtype=torch.int64)
    c[1, 3:20] = 4
    kl, _ = entropy_divergences(c, num_bits=3, start_bin=4, backend=backend)
    assert torch.isinf(kl[0]).all() and (kl[0] > 0).all()
    assert torch.isfinite(kl[1, :17]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_bin_histogram_is_its_own_quantization(backend):
    # one bin, threshold 1: P = Q = the bin, KL 0 (no bin 1 to copy into bin 0)
    kl, cand = entropy_divergences(torch.tensor([[5]]), start_bin=1, backend=backend)
    assert cand.tolist() == [1] and kl.tolist() == [[0.0]]


@pytest.mark.parametrize("smooth", [1, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_an_empty_unit_falls_back_to_the_histograms_start(smooth, dtype):
    """No data: no non-empty bin, so ``amax`` is ``lo`` (0 bins past it), on either path."""
    c = torch.zeros(2, 256, dtype=dtype)
    c[1, :200] = 3
    got = entropy_amax(Hist(c, torch.zeros(2), torch.full((2,), 128.0), absolute=True),
                       smooth=smooth)
    assert got[0].item() == 0.0 and got[1].item() > 0


@pytest.mark.parametrize(("counts", "bits"), [
    ([723] * 5 + [484] * 5, 2),  # flat groups, each count differing from the group before
    ([677] * 3 + [0] * 3 + [148] * 3 + [0] * 3, 3),  # an empty group before a flat one
])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_proportional_p_and_q_score_exactly_zero_and_the_last_wins(counts, bits, dtype):
    """Where the loop's every ``p / q`` is 1 (KL 0 exactly) both forms give 0.0, not rounding
    noise, and ``entropy_amax`` takes the last of those thresholds."""
    c = torch.tensor([counts], dtype=dtype)
    kl, cand = entropy_divergences(c, num_bits=bits, start_bin=1)
    b = c[0].double().numpy().copy()
    b[0] = b[1]
    ref = torch.tensor([trt_kl(b, int(i), 1 << (bits - 1)) for i in cand])
    zero = ref == 0
    assert zero.sum() >= 1 and (kl[0, zero] == 0).all()
    h = Hist(c, torch.zeros(1), torch.tensor([float(len(counts))]), absolute=True)
    got = entropy_amax(h, num_bits=bits, start_bin=1, trim=False)
    assert got.item() == float(cand[zero][-1])


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_every_smoothed_window_infinite_falls_back_to_the_last_bins_right_edge(dtype):
    # candidates 12 (bin 11 empty, a count beyond: infinite) and 13 (finite), smooth 3:
    # both windows hold the infinite one, so no finite divergence is left
    c = torch.zeros(1, 64, dtype=dtype)
    c[0, 10] = c[0, 12] = 5
    h = Hist(c, torch.zeros(1), torch.tensor([32.0]), absolute=True)
    got = entropy_amax(h, num_bits=3, start_bin=12, smooth=3)
    assert got.item() == 13 * 0.5
    torch.testing.assert_close(got, ref_entropy_amax(c, 0.5, num_bits=3, start_bin=12, smooth=3))


def _horizon_bin(row, *, nq, start, stride, smooth):
    """Horizon's ``_compute_amax_entropy`` in bins, with its ``stride``: every ``stride``-th
    threshold from ``start``, full ``smooth``-wide window sums (``range(len(div) - smooth -
    1)``), the last minimum ``j``, ``amax = edges[j * stride + start + smooth // 2]``."""
    b = np.asarray(row, dtype=np.float64).copy()
    b[0] = b[1]
    div = [horizon_kl(b, i, nq)[0] for i in range(start, len(b) + 1, stride)]
    sums = [sum(div[j:j + smooth]) for j in range(len(div) - smooth - 1)]
    j = max(k for k, v in enumerate(sums) if v == min(sums))
    return j * stride + start + smooth // 2


@pytest.mark.parametrize(("stride", "smooth"), [(1, 2), (1, 4), (2, 3), (3, 2)])
def test_horizon_amax_is_edges_at_j_stride_plus_start_plus_half_the_window(stride, smooth):
    g = torch.Generator().manual_seed(stride * 10 + smooth)
    x = torch.randn(2, 4000, generator=g).abs() ** 2
    top = x.amax(1)
    counts = torch.stack([torch.histc(r, 96, 0, float(t)) for r, t in zip(x, top)]).long()
    want = torch.tensor([_horizon_bin(r, nq=4, start=16, stride=stride, smooth=smooth)
                         for r in counts.numpy()], dtype=torch.float32)
    h = Hist(counts, torch.zeros(2), top, absolute=True)
    got = horizon_entropy_amax(h, num_bits=3, start_bin=16, stride=stride, smooth=smooth)
    torch.testing.assert_close(got, want * top / 96, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("bins", "ok"), [(137, False), (138, True)])
def test_horizon_needs_one_full_window(bins, ok):
    """``len(cand) - smooth - 1`` windows: 10 thresholds and smooth 9 leave none."""
    c = torch.ones(1, bins, dtype=torch.int64)
    h = Hist(c, torch.zeros(1), torch.tensor([float(bins)]), absolute=True)
    if ok:
        assert horizon_entropy_amax(h).item() == 128 + 4  # one window, j = 0
    else:
        with pytest.raises(ValueError, match="leave no full smooth=9 window"):
            horizon_entropy_amax(h)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_per_unit_stop_of_any_integer_dtype_ends_the_candidates(dtype):
    """Candidates past a unit's ``stop`` are NaN; ``stop`` up to it scored as without one."""
    c = torch.zeros(2, 48, dtype=torch.int64)
    c[:, 2:40] = torch.arange(1, 39)
    full, cand = entropy_divergences(c, num_bits=3, start_bin=8)
    kl, _ = entropy_divergences(c, num_bits=3, start_bin=8,
                                stop=torch.tensor([20, 48], dtype=dtype))
    assert torch.isnan(kl[0, cand > 20]).all() and not torch.isnan(kl[1]).any()
    assert torch.equal(kl[0, cand <= 20], full[0, cand <= 20]) and torch.equal(kl[1], full[1])
