"""compat.torch_ao against torch.ao 2.13 (probe s20): a batch whose range overflows
``HistogramObserver``'s state dtype raises a ``RuntimeError`` as torch.ao's (and a
``ValueError``), and ``with_args`` / ``with_callable_args`` chains nest as torch.ao's
``_PartialWrapper`` does (repr, keywords, ``qconfig_equals``), building the same observers."""

from __future__ import annotations

import collections
import itertools
import warnings

import pytest
import torch
from torch.ao import quantization as tq
from torch.ao.quantization.qconfig import QConfig, _partial_wrapper_equals, qconfig_equals

from quantscope.compat import torch_ao as qa


# ------------------------------------------------------------------ overflowing batch
def _run(cls, cast, first, batch, script=False):
    """The error type a batch raises (None: no error) and the state left after it."""
    obs = getattr(cls(bins=64), cast)()
    if script:
        obs = torch.jit.script(obs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if first is not None:
            obs(first)
        before = [t.clone() for t in (obs.histogram, obs.min_val, obs.max_val)]
        try:
            obs(batch)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return type(e), str(e), before, obs
    return None, "", before, obs


F64 = torch.float64
# (state cast, first batch, overflowing batch): torch.ao raises RuntimeError on each
RAISING = {
    "half_one_value": ("half", torch.tensor([-7.0], dtype=F64),
                       torch.tensor([-41705.3, 143988.36])),
    "float_one_value": ("float", torch.tensor([1.0]), torch.tensor([-1.0, 1e300], dtype=F64)),
    "float_two_values": ("float", torch.tensor([1.0, 2.0]),
                         torch.tensor([-1.0, 1e300], dtype=F64)),
    "float_one_value_neg": ("float", torch.tensor([3.0]),
                            torch.tensor([-1e300, 1.0], dtype=F64)),
}


@pytest.mark.parametrize("case", list(RAISING))
def test_overflow_raises_runtime_error_as_torch(case):
    cast, first, batch = RAISING[case]
    want, _, _, _ = _run(tq.HistogramObserver, cast, first, batch)
    got, msg, before, obs = _run(qa.HistogramObserver, cast, first, batch)
    assert want is RuntimeError
    assert got is qa.StateOverflowError and issubclass(got, want) and issubclass(got, ValueError)
    assert "exceeds the observer's" in msg and "state is left as it was" in msg
    for old, new in zip(before, (obs.histogram, obs.min_val, obs.max_val)):
        assert torch.equal(old, new)


def test_overflow_where_torch_stores_inf_is_still_a_value_error():
    # torch.ao stores inf here (a NaN scale later); quantscope refuses, as documented
    args = ("half", torch.tensor([-1.0, 2.0]), torch.tensor([-41705.3, 143988.36]))
    assert _run(tq.HistogramObserver, *args)[0] is None
    got = _run(qa.HistogramObserver, *args)[0]
    assert got is qa.StateOverflowError and issubclass(got, (ValueError, RuntimeError))


@pytest.mark.parametrize("case", ["half_one_value", "float_one_value"])
def test_overflow_scripted_is_runtime_error_as_torch(case):
    cast, first, batch = RAISING[case]
    want = _run(tq.HistogramObserver, cast, first, batch, script=True)[0]
    got = _run(qa.HistogramObserver, cast, first, batch, script=True)[0]
    assert want is RuntimeError and got is RuntimeError  # TorchScript's plain RuntimeError


def test_state_overflow_error_exported():
    assert "StateOverflowError" in qa.__all__
    assert issubclass(qa.StateOverflowError, ValueError)
    assert issubclass(qa.StateOverflowError, RuntimeError)


# ------------------------------------------------------------------ with_args chains
def _lazy_eps():
    return 1e-3


def _lazy_qmax():
    return 100


STEPS = [("args", {"quant_min": 0}), ("args", {"quant_max": 15}),
         ("args", {"quant_min": 2, "eps": 0.5}), ("callable", {"eps": _lazy_eps}),
         ("callable", {"quant_max": _lazy_qmax})]
CHAINS = [c for n in (1, 2, 3) for c in itertools.product(range(len(STEPS)), repeat=n)]


def _build(cls, chain):
    ctor = cls
    for i in chain:
        kind, kw = STEPS[i]
        ctor = ctor.with_args(**kw) if kind == "args" else ctor.with_callable_args(**kw)
    return ctor


def _shape(ctor):
    """The wrapper's structure: each level's keywords, args and callable_args, inward."""
    out = []
    while isinstance(ctor, tq.observer._PartialWrapper):
        out.append((dict(ctor.p.keywords), ctor.p.args, dict(ctor.callable_args)))
        ctor = ctor.p.func
    return out, ctor


def _ours_repr(ctor):
    return repr(ctor).replace("quantscope.compat.torch_ao", "torch.ao.quantization.observer")


def _state(obs):
    return (obs.dtype, obs.eps.item(), obs.quant_min, obs.quant_max)


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: "-".join(map(str, c)))
def test_chain_built_as_torch(chain):
    ours, ref = _build(qa.MinMaxObserver, chain), _build(tq.MinMaxObserver, chain)
    (got_shape, got_cls), (want_shape, want_cls) = _shape(ours), _shape(ref)
    assert got_shape == want_shape and (got_cls, want_cls) == (qa.MinMaxObserver,
                                                                tq.MinMaxObserver)
    assert _ours_repr(ours) == repr(ref)
    assert ours.p.keywords == ref.p.keywords and ours.__name__ == "MinMaxObserver"
    # torch.ao's comparison of two separately built chains, and through a QConfig
    again_ours, again_ref = _build(qa.MinMaxObserver, chain), _build(tq.MinMaxObserver, chain)
    assert _partial_wrapper_equals(ours, again_ours) == _partial_wrapper_equals(ref, again_ref)
    assert (qconfig_equals(QConfig(activation=ours, weight=ours),
                           QConfig(activation=again_ours, weight=again_ours))
            == qconfig_equals(QConfig(activation=ref, weight=ref),
                              QConfig(activation=again_ref, weight=again_ref)))
    fq_ours = tq.FakeQuantize.with_args(observer=again_ours)
    fq_ref = tq.FakeQuantize.with_args(observer=again_ref)
    assert (_partial_wrapper_equals(tq.FakeQuantize.with_args(observer=ours), fq_ours)
            == _partial_wrapper_equals(tq.FakeQuantize.with_args(observer=ref), fq_ref))
    # the same observer, with or without a call keyword
    for call_kw in ({}, {"eps": 0.125}, {"quant_max": 31}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                want = _state(ref(**call_kw))
            except (AssertionError, ValueError) as e:
                want = type(e)
            try:
                got = _state(ours(**call_kw))
            except (AssertionError, ValueError) as e:
                got = type(e)
        assert got == want


PAIRS = [c for n in (1, 2) for c in itertools.product(range(len(STEPS)), repeat=n)]


def test_chain_pairs_compare_as_torch():
    counts = collections.Counter()
    for a, b in itertools.product(PAIRS, repeat=2):
        got = _partial_wrapper_equals(_build(qa.MinMaxObserver, a), _build(qa.MinMaxObserver, b))
        want = _partial_wrapper_equals(_build(tq.MinMaxObserver, a),
                                       _build(tq.MinMaxObserver, b))
        assert got == want, (a, b)
        counts[want] += 1
    assert counts[True] and counts[False]  # both answers occur in the grid


def test_histogram_chain_nests_and_builds():
    ours = qa.HistogramObserver.with_args(bins=64).with_callable_args(eps=_lazy_eps) \
        .with_args(dtype=torch.qint8)
    ref = tq.HistogramObserver.with_args(bins=64).with_callable_args(eps=_lazy_eps) \
        .with_args(dtype=torch.qint8)
    assert _shape(ours)[0] == _shape(ref)[0] and ours.__name__ == "HistogramObserver"
    got, want = ours(), ref()
    assert isinstance(got, qa.HistogramObserver)
    assert (got.bins, got.dtype, got.eps.item()) == (want.bins, want.dtype, want.eps.item())
