"""compat.quark's histogram observers against AMD Quark 0.13 on several batches: Quark's own
grid once a batch widens the range (counts, edges, scales bit for bit), its zero-skipping
percentile's range, its MSE pricing of symmetric unsigned and asymmetric fp8 candidates, and
the Pro wrapper's torch.ao code range (reduce_range, symmetric unsigned zero points). Runs in
the peers' venv."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from tiers import each_value

pytestmark = [pytest.mark.peers, pytest.mark.xdist_group("quark")]

pytest.importorskip("quark")  # quark_twins imports quark.torch when a test first uses it

from quark_twins import qo, quark_config

from quantscope.compat import quark


def _pair(name: str, dtype: str, symmetric: bool, **kw):
    """Quark's observer ``name`` and quantscope's, of one per-tensor config (``kw``: the
    constructors')."""
    c = quark_config(name, dtype=dtype, symmetric=symmetric)
    return getattr(qo, name)(c, None, **kw), getattr(quark, name)(c, None, **kw)


def _qparams(obs):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return obs._calculate_qparams()


def _feed(obs, batches):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in batches:
            obs(x)


def _assert_same_run(ref, ours, batches):
    """Both observers fed ``batches``: the same histogram, qparams and priced range."""
    _feed(ref, batches)
    _feed(ours, batches)
    assert torch.equal(ref.calib_bin_edges, ours.calib_bin_edges)
    assert torch.equal(ref.calib_hist, ours.calib_hist)
    a, b = _qparams(ref), _qparams(ours)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (a, b)
    assert torch.equal(ref.min_val, ours.min_val) and torch.equal(ref.max_val, ours.max_val)


def _batches(case: str):
    g = torch.Generator().manual_seed(3)
    if case == "grow":  # every batch widens the range: Quark appends bins of the first width
        return [torch.randn(16, 64, generator=g) * s for s in (1, 2, 4)]
    if case == "relu":  # a few bins appended at the top by the second batch
        return [torch.randn(16, 64, generator=g).relu() + 0.3 * (torch.randn(16, 64, generator=g)
                > 0) for _ in range(2)]
    if case == "neg":  # |x| in [0.5, 1.5]: symmetric bins of |x|
        return [-torch.rand(16, 64, generator=g) - 0.5 for _ in range(2)]
    return [torch.randn(16, 64, generator=g) * s for s in (4, 1)]  # "shrink": no widening


@pytest.mark.parametrize("case", ["grow", "relu", "neg", "shrink"])
@pytest.mark.parametrize("dtype", ["int4", "uint4", "int8", "uint8", "fp8_e4m3", "fp8_e5m2"])
def test_percentile_several_batches_bitwise(dtype, case):
    for symmetric in (True, False):
        _assert_same_run(*_pair("PerTensorPercentileObserver", dtype, symmetric), _batches(case))


@pytest.mark.parametrize(("dtype", "case"),
                         each_value(["int4", "uint4", "int8", "uint8", "fp8_e4m3", "fp8_e5m2"],
                                    ["grow", "relu", "neg", "shrink"]))
def test_mse_symmetric_several_batches_bitwise(dtype, case):
    # symmetric unsigned: Quark prices (0, c) with zero point 0 over [0, qmax], not mid-range
    _assert_same_run(*_pair("PerTensorMSEObserver", dtype, True), _batches(case))


@pytest.mark.parametrize("dtype", ["int8", "uint8", "fp8_e4m3"])
def test_mse_asymmetric_nonnegative_batches_bitwise(dtype):
    _assert_same_run(*_pair("PerTensorMSEObserver", dtype, False), _batches("relu"))


def test_asymmetric_fp8_mse_prices_candidates_below_zero_as_quark():
    """Asymmetric bins of a growing zero-centred range put candidates below 0: Quark's fp8
    pricing takes them as their magnitude (it ran; quantscope refused them)."""
    base = torch.randn(8, 64, generator=torch.Generator().manual_seed(7))
    batches = [base, base * 1.7, base * 3.1]
    _assert_same_run(*_pair("PerTensorMSEObserver", "fp8_e4m3", False), batches)


def test_asymmetric_mse_refuses_an_all_negative_estimate():
    """All-negative data: Quark's fp8 scale of (0, centre < 0) is 0; quantscope raises."""
    ref, ours = _pair("PerTensorMSEObserver", "fp8_e4m3", False)
    batches = _batches("neg")[:1]
    _feed(ref, batches)
    _feed(ours, batches)
    assert float(_qparams(ref)[0]) == 0.0
    with pytest.raises(ValueError, match="negative"):
        _qparams(ours)


def test_mse_refuses_a_grid_whose_edges_and_bins_disagree():
    """Quark's arange can give an edge more or less than its bin count; its MSE search then
    fails on the sizes (RuntimeError): quantscope's says why."""
    ref, ours = _pair("PerTensorMSEObserver", "fp8_e4m3", False)
    batches = _batches("grow")
    _feed(ref, batches)
    _feed(ours, batches)
    assert ours.calib_hist.numel() != ours.calib_bin_edges.numel() - 1
    with pytest.raises(RuntimeError):
        _qparams(ref)
    with pytest.raises(ValueError, match="bins and"):
        _qparams(ours)


def test_downward_widening_adds_old_counts_as_quark():
    """A batch below the range: Quark adds the old counts to the new grid's first bins."""
    g = torch.Generator().manual_seed(5)
    batches = [torch.rand(32, 64, generator=g) + 1.0, torch.rand(4, 64, generator=g) * 2 - 0.5]
    _assert_same_run(*_pair("PerTensorPercentileObserver", "int8", False), batches)


def _post_relu(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g).relu()
    return torch.where(x > 0, x + 0.5, torch.zeros(()))  # exact zeros, the rest >= 0.5


@pytest.mark.parametrize("dtype", ["uint8", "int8", "fp8_e4m3"])
def test_asymmetric_percentile_bins_the_nonzero_range(dtype):
    """Quark drops the zeros before it takes min / max: the grid starts at 0.5, not 0."""
    ref, ours = _pair("PerTensorPercentileObserver", dtype, False)
    _assert_same_run(ref, ours, [_post_relu(0), _post_relu(1) * 1.5])
    assert float(ours.calib_bin_edges[0]) > 0.5


def test_percentile_one_hot_batch_as_quark():
    _assert_same_run(*_pair("PerTensorPercentileObserver", "uint8", False), [torch.eye(16)])


@pytest.mark.parametrize("symmetric", [True, False])
def test_percentile_all_zero_first_batch_starts_no_grid(symmetric):
    """Skipped zeros only: the first batch with data starts the grid (Quark's starts a grid at
    [0, 4200 eps] and fails on the next batch when asymmetric)."""
    g = torch.Generator().manual_seed(4)
    data = torch.randn(4, 16, generator=g)
    _, ours = _pair("PerTensorPercentileObserver", "int8", symmetric)
    _, fresh = _pair("PerTensorPercentileObserver", "int8", symmetric)
    _feed(ours, [torch.zeros(4, 16), data])
    _feed(fresh, [data])
    assert torch.equal(ours.calib_bin_edges, fresh.calib_bin_edges)
    assert torch.equal(ours.calib_hist, fresh.calib_hist)
    for x, y in zip(_qparams(ours), _qparams(fresh), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", ["uint4", "int8", "uint8"])
def test_pro_code_range_as_torch_ao_gets_it(dtype, symmetric, reduce_range):
    """Quark hands torch.ao its code range as a custom one: reduce_range halves it, and a
    symmetric quint8 takes its lower midpoint (127, or 63), quint4x2 zero point 0."""
    ref, ours = _pair("PerTensorHistogramObserverPro", dtype, symmetric, reduce_range=reduce_range)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) + (0 if symmetric else 1)
    _feed(ref, [x])
    _feed(ours, [x])
    a, b = _qparams(ref), _qparams(ours)
    for p, q in zip(a, b, strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), (a, b)
