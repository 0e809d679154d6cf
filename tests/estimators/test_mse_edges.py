"""Edges of the MSE range searches: overflowing errors, the global patience rule's stop
(``mse_select``: patience 0, one candidate after the last improving one), the expanded
grid's incumbent, and the power-of-two search's ties (Quark's rule)."""

from __future__ import annotations

import math

import pytest
import torch

from quantscope import kernels
from quantscope.estimators import mse_search, pow2_search
from quantscope.kernels import ops
from quantscope.presets import NVFP4
from quantscope.qdq import fake_quantize_units
from quantscope.qparams import qparams_from_range
from quantscope.spec import QuantSpec
from quantscope.stats.minmax import unit_minmax

_KERNEL = pytest.param("kernel", marks=pytest.mark.skipif(
    not kernels.available("mse_search"), reason="no C compiler (or QUANTSCOPE_NO_KERNEL)"))
BACKENDS = ["torch", "ops", _KERNEL]
LINEAR = [1 - 0.01 * i for i in range(95)]  # linear_search's candidates


def _true_error(units, lo, hi, spec):
    """Per-unit float64 squared error of the quantizer of ``(lo, hi)``: no float32 square."""
    qp = qparams_from_range(lo, hi, spec)
    scale = qp.effective_scale.expand_as(lo)[:, None]
    q = fake_quantize_units(units, scale, qp.zero_point.float()[:, None], spec)
    return (q.double() - units.double()).pow(2).sum(-1)


def _huge_units():
    """Unit 0 ordinary, units 1 and 2 so large that every float32 squared error overflows
    (``float32_squares``: the compat classes' arithmetic; exact float64 squares do not)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    x[1:] *= 1e22
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", [{"patience": None}, {"patience": 2, "per_unit_patience": False},
                                  {"patience": 2}])
def test_overflowed_errors_never_replace_the_best(backend, rule):
    # linear_search's search (tie last) on weights whose every candidate's error is inf
    # (squares rounded to float32, as Horizon's compat class prices them): no inf candidate
    # replaces the min-max incumbent, so the range is min-max's
    spec = QuantSpec("int8", "tensor")
    x = _huge_units()
    lo, hi = unit_minmax(x)
    amax = torch.maximum(-lo, hi)
    rule = {**rule, "float32_squares": True}
    res = mse_search(x, -amax, amax, spec, factors=LINEAR, tie="last", global_grid=1,
                     backend=backend, **rule)
    assert torch.isinf(res.error[1:]).all()  # the case: every error overflowed
    assert res.index[1:].tolist() == [-1, -1]
    assert torch.equal(res.hi[1:], amax[1:]) and torch.equal(res.lo[1:], -amax[1:])
    got = _true_error(x, res.lo, res.hi, spec)
    minmax = _true_error(x, -amax, amax, spec)
    assert torch.isfinite(got).all() and (got <= minmax).all()
    # the finite unit is searched as before: the same choice on every backend
    ref = mse_search(x[:1], -amax[:1], amax[:1], spec, factors=LINEAR, tie="last",
                     global_grid=1, backend="torch", **rule)
    assert res.index[0] == ref.index[0] and torch.equal(res.error[:1], ref.error)


def test_linear_search_overflow_not_worse_than_minmax():
    from quantscope.estimators import linear_search
    spec = QuantSpec("int8", "tensor")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).reshape(1, -1) * 1e22
    res = linear_search(x, None, None, spec)
    lo, hi = unit_minmax(x)
    amax = torch.maximum(-lo, hi)
    assert _true_error(x, res.lo, res.hi, spec) <= _true_error(x, -amax, amax, spec)


def test_select_op_keeps_a_finite_best_over_inf():
    inf = float("inf")
    err = torch.tensor([[inf, 2.0, inf], [1.0, inf, inf], [inf, inf, inf]],
                       dtype=torch.float64)
    same = torch.zeros_like(err, dtype=torch.bool)
    incumbent = torch.tensor([inf, 3.0, inf], dtype=torch.float64)
    idx, best = ops.mse_select(err, same, incumbent, 3, -1, True, False, True)
    assert idx.tolist() == [1, 0, -1] and best.tolist() == [1.0, 2.0, inf]
    idx, _ = ops.mse_select(err[2:], same[2:], incumbent, 1, -1, True, False, True)
    assert idx.tolist() == [-1, -1, -1]


def test_an_overflowed_error_improves_no_unit_for_the_global_rule():
    """Pin (s61 mutation): the global rule counts a row as improving only where ``beats``
    takes it, and ``beats`` never takes an inf error, not even as a tie kept last (inf <=
    inf): an overflowed unit would otherwise keep the rule searching forever, and take
    the last inf candidate over its incumbent."""
    inf = float("inf")
    best = torch.tensor([inf, 2.0], dtype=torch.float64)
    err = torch.tensor([[inf, 3.0], [inf, 2.5], [1.0, inf]], dtype=torch.float64)
    for tie_last in (False, True):
        assert ops.improved_rows(err, best, tie_last).tolist() == [False, False, True]
    # ties kept last, the global rule with patience 1 (mse_tiles._State's rules): candidate
    # 0 improves unit 1, candidate 1 improves nothing (unit 0's inf ties its inf best), so
    # the rule stops after it and candidate 2 is never taken
    err = torch.tensor([[inf, 1.0], [inf, 3.0], [inf, 0.5]], dtype=torch.float64)
    assert ops.improved_rows(err, best, True).tolist() == [True, False, True]
    assert ops.stop_after(ops.improved_rows(err, best, True), 1).tolist() == [1]
    idx, best = ops.mse_select(err, torch.zeros_like(err, dtype=torch.bool), best, 3, 1,
                               False, True, True)
    assert idx.tolist() == [-1, 0] and best.tolist() == [inf, 1.0]


@pytest.mark.parametrize(("improved", "patience", "stop"), [
    ([True, False, False, False], 1, 1), ([True, False, False, False], 2, 2),
    ([True, False, False, False], 3, 3), ([True, False, False, False], 4, 4),
    ([True, False, True, False, False], 2, 4), ([False, True, False, False], 1, 0),
    ([False, False, False], 2, 1),
    ([True, True, True], 1, 3), ([False, False], 0, 0), ([True, False], 0, 0),
])
def test_the_global_rule_stops_after_exactly_patience_stale_candidates(improved, patience,
                                                                       stop):
    """Pin (s61 mutation): ``stop_after`` is the candidate after which the global rule
    stops: the search state stops once ``patience`` candidates in a row have improved no
    unit (``g_stale >= patience``), counted from the last that improved (or from the start),
    ``len(improved)`` if that never happens. One candidate later takes one the rule never
    looks at."""
    got = ops.stop_after(torch.tensor(improved), patience)
    assert got.dtype == torch.int64 and got.tolist() == [stop]


def test_mse_select_under_the_global_rule_takes_no_candidate_past_its_stop():
    """Pin (s61 mutation): patience 1, the global rule alone: candidate 0 improves on the
    incumbent, candidate 1 does not, so the rule stops there and candidate 2's lower error
    is never taken."""
    err = torch.tensor([[1.0], [1.5], [0.5]], dtype=torch.float64)
    same = torch.zeros_like(err, dtype=torch.bool)
    idx, best = ops.mse_select(err, same, torch.tensor([2.0], dtype=torch.float64), 3, 1,
                               False, True, False)
    assert idx.tolist() == [0] and best.tolist() == [1.0]


@pytest.mark.parametrize("per_unit", [False, True])
def test_patience_zero_still_takes_the_first_candidate(per_unit):
    """Pin (s61 mutation): with patience 0 the search state looks at candidate 0 (nothing
    has stopped yet) and stops right after it, under the global rule alone as under both
    rules: candidate 0 replaces unit 0's incumbent, candidate 1's lower errors are never
    taken."""
    err = torch.tensor([[1.0, 3.0], [0.5, 0.2]], dtype=torch.float64)
    same = torch.zeros_like(err, dtype=torch.bool)
    incumbent = torch.tensor([2.0, 2.0], dtype=torch.float64)
    idx, best = ops.mse_select(err, same, incumbent, 2, 0, per_unit, True, False)
    assert idx.tolist() == [0, -1] and best.tolist() == [1.0, 2.0]


def _expand_case():
    """Units whose min / max do not survive ``(v * 1.8) / 1.8`` in float32."""
    v = torch.linspace(1.0, 3.0, 4001)
    off = v[(v * 1.8) / 1.8 != v][:8]
    assert off.numel() == 8  # the case exists
    g = torch.Generator().manual_seed(0)
    x = torch.rand(8, 32, generator=g) * 2 - 1  # inside (-1, 1): the ends are set below
    x[:, 0], x[:, 1] = -off, off.flip(0)
    return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_incumbent_is_minmax_bitwise(backend):
    # candidates far inside the range lose to the incumbent, which must be min-max itself
    spec = QuantSpec("int8", "channel", symmetric=False)
    x = _expand_case()
    lo, hi = unit_minmax(x)
    res = mse_search(x, lo, hi, spec, expand=1.8, factors=[0.2, 0.25], patience=None,
                     backend=backend)
    assert res.index.tolist() == [-1] * 8
    assert torch.equal(res.lo, lo) and torch.equal(res.hi, hi)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_search_never_worse_than_minmax(backend):
    spec = QuantSpec("int8", "channel", symmetric=False)
    x = _expand_case()
    lo, hi = unit_minmax(x)
    res = mse_search(x, lo, hi, spec, maxshrink=1 - 0.8 / 1.8, grid=200, patience=1000,
                     expand=1.8, backend=backend)
    assert (res.error.double() <= _true_error(x, lo, hi, spec)).all()


def test_expanded_nvfp4_global_amax_is_the_tensors():
    spec = NVFP4
    x = _expand_case().reshape(-1, 16)
    lo, hi = unit_minmax(x)
    res = mse_search(x, lo, hi, spec, expand=1.8, global_grid=1, patience=None,
                     factors=[1.0, 0.9])
    assert res.global_amax.item() == max(-lo.min().item(), hi.max().item())


def _quark_pow2(x: torch.Tensor, spec: QuantSpec) -> float:
    """Quark's PerTensorPowOf2MinMSEObserver from its formula: the min-max power-of-two
    scale ``2 ** -pos``, then ``2 ** -(pos + i - 2)`` for ``i = 0 .. 4`` (the largest
    first), each scored by ``sum((clamp(round(x / s), qmin, qmax) * s - x) ** 2)``, the
    first strict minimum kept."""
    lo, hi = unit_minmax(x.reshape(1, -1))
    s0 = qparams_from_range(lo, hi, spec).scale.item()
    pos = -round(math.log2(s0))
    best, chosen = float("inf"), s0
    for i in range(5):
        s = 2.0 ** -(pos + i - 2)
        d = torch.clamp(torch.round(x / s), spec.qmin, spec.qmax) * s - x
        err = float(d.pow(2).sum())
        if err < best:
            best, chosen = err, s
    return chosen


def _pow2_cases():
    yield torch.tensor([[0.75, -0.5, 0.25, 0.0, 0.125, -0.625]])  # exact at 4x, 2x and 1x
    yield torch.tensor([[1.0, -1.0, 0.5, 0.25]])
    yield torch.randn(4, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", [None, "torch", "ops"])
def test_pow2_ties_as_quark(backend):
    spec = QuantSpec("int8", "tensor", scale="pow2:round")
    for x in _pow2_cases():
        u = x.reshape(1, -1)
        lo, hi = unit_minmax(u)
        res = mse_search(u, lo, hi, spec, factors=[4.0, 2.0, 1.0, 0.5, 0.25], patience=None,
                         global_grid=1, incumbent=False, backend=backend)
        got = qparams_from_range(res.lo, res.hi, spec).scale.item()
        assert got == _quark_pow2(x, spec)
        assert pow2_search(u, lo, hi, spec).index.tolist() == res.index.tolist()


def test_pow2_search_exact_tie_keeps_the_largest_scale():
    spec = QuantSpec("int8", "tensor", scale="pow2:round")
    u = torch.tensor([[0.75, -0.5, 0.25, 0.0, 0.125, -0.625]])
    res = pow2_search(u, None, None, spec)
    assert res.index.tolist() == [0]  # factor 4: every one of 4x, 2x, 1x is exact


def _huge(k: int) -> torch.Tensor:
    """Finite float32 values whose squared errors overflow float32 (max |x| ~ 2 ** k)."""
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(k)) * 2.0 ** k


@pytest.mark.parametrize("k", [64, 80, 123])
def test_pow2_search_keeps_min_max_where_no_error_is_finite(k):
    """Quark's best starts as min-max with an infinite error: no candidate beats it. The
    first candidate (4x min-max, 16x its error) stood instead, and past 2 ** 122 its range
    overflowed float32 into a 'lo and hi must be finite' error."""
    spec = QuantSpec("int8", "tensor", scale="pow2:round")
    x = _huge(k)
    u = x.reshape(1, -1)
    lo, hi = unit_minmax(u)
    res = pow2_search(u, None, None, spec)
    assert qparams_from_range(res.lo, res.hi, spec).scale.item() == _quark_pow2(x, spec)
    if k > 64:  # (at 2 ** 64 the smaller scales' errors are still finite)
        assert torch.equal(res.lo, lo) and torch.equal(res.hi, hi)
        assert res.index.tolist() == [2]


def test_mse_search_incumbent_must_be_bool():
    spec = QuantSpec("int8", "tensor")
    with pytest.raises(TypeError, match="incumbent must be a bool"):
        mse_search(torch.ones(1, 4), None, None, spec, incumbent="no")


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
def test_pow2_mse_matches_quark_observer():
    pytest.importorskip("quark")
    from quark.torch.quantization.config.config import QTensorConfig
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
    from quark.torch.quantization.observer import observer as qo

    import quantscope
    spec = QuantSpec("int8", "tensor", scale="pow2:round")
    cfg = QTensorConfig(dtype=Dtype.int8, qscheme=QSchemeType.per_tensor, symmetric=True,
                        round_method=RoundType.half_even, scale_type=ScaleType.float,
                        is_dynamic=False, observer_cls=qo.PerTensorPowOf2MinMSEObserver)
    for x in (*_pow2_cases(), _huge(64), _huge(80)):  # 80: every error inf, min-max stands
        theirs = qo.PerTensorPowOf2MinMSEObserver(cfg)
        theirs(x)
        ours = quantscope.get_observer("pow2_mse", spec)
        ours(x)
        assert ours.qparams().scale.item() == float(theirs._calculate_qparams()[0])


def _triton_device():
    """CUDA, or the CPU under Triton's interpreter (tests/conftest.py sets it); else skip."""
    import os
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton compiled without a GPU: no interpreter")
    return "cpu"


@pytest.mark.parametrize("use_global", [False, True])
def test_triton_select_keeps_a_finite_best_over_inf(use_global):
    from quantscope.kernels import select_ops
    from quantscope.kernels.triton import mse

    dev, inf = _triton_device(), float("inf")
    err = torch.tensor([[inf, 2.0, inf], [1.0, inf, inf], [inf, inf, inf]],
                       dtype=torch.float64)
    same = torch.zeros_like(err, dtype=torch.bool)
    inc = torch.tensor([inf, 3.0, inf], dtype=torch.float64)
    patience = 2 if use_global else None
    gstop = select_ops._global_stop(err, inc, 3, patience or -1, True)
    want = ops.mse_select(err, same, inc, 3, patience or -1, False, use_global, True)
    idx, best = mse.mse_select(err.to(dev), same.to(dev), inc.to(dev), gstop.to(dev), 3,
                               patience, False, use_global, True, block_u=16)
    assert idx.cpu().tolist() == [1, 0, -1] and torch.equal(idx.cpu(), want[0])
    assert torch.equal(best.cpu(), want[1])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # inf's NaN prices
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("use_global", [False, True])
def test_triton_mx_search_never_takes_a_non_finite_candidate(use_global):
    from quantscope.kernels import block_ops

    dev = _triton_device()
    huge = _huge_units().reshape(-1, 32)[2:].contiguous()
    held = huge.clone()
    held[:, 5] = float("inf")  # every candidate's error, the incumbent's too, is NaN
    f = torch.tensor(LINEAR[:20], device=dev)
    rules = (20, 2 if use_global else -1, False, use_global, True)
    # ~1e22: the squares exact in float64, every price finite; with inf: none, min-max kept
    for x, finite in ((huge.to(dev), True), (held.to(dev), False)):
        lo, hi = unit_minmax(x)
        want = block_ops._torch_mx_mse(x, lo, hi, f, lo, hi, "fp8_e4m3", "floor", *rules)
        got = block_ops._cuda_mx_mse(x, lo, hi, f, lo, hi, "fp8_e4m3", "floor", *rules)
        assert bool(torch.isfinite(want[1]).all()) if finite else \
            want[0].tolist() == [-1] * x.shape[0]
        assert torch.equal(got[0].cpu(), want[0].cpu())
        torch.testing.assert_close(got[1].cpu(), want[1].cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("given", ["lo", "hi"])
def test_a_given_end_is_searched_from_and_the_other_computed(given):
    """``lo`` / ``hi`` None: computed, each on its own; a given one is kept (it was dropped
    for the units' own min / max when the other end was None)."""
    units = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    lo, hi = unit_minmax(units)
    spec = QuantSpec("int4", symmetric=False)
    ends = {"lo": lo * 0.5, "hi": hi} if given == "lo" else {"lo": lo, "hi": hi * 0.5}
    one = {**ends, ("hi" if given == "lo" else "lo"): None}
    want, got = mse_search(units, spec=spec, **ends), mse_search(units, spec=spec, **one)
    assert torch.equal(got.lo, want.lo) and torch.equal(got.hi, want.hi)
    full = mse_search(units, None, None, spec)  # both computed: another range
    assert not (torch.equal(got.lo, full.lo) and torch.equal(got.hi, full.hi))
