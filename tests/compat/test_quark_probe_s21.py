"""Probe s21: compat.quark's PerTensorHistogramObserverPro on non-finite input (Quark hands
the batch to torch.ao's HistogramObserver: +-inf dropped with a warning, NaN an error in
forward), and stats.histogram.linear_counts where ``(x - lo) * bins`` overflows float32
(torch.histc counts those values in bin 0). The torch references run anywhere; the test
marked ``peers`` runs Quark itself (the peers' venv)."""

from __future__ import annotations

import contextlib
import io
import math
import platform
import warnings

import pytest
import torch
from torch.ao.quantization import HistogramObserver

from quantscope.compat import quark
from quantscope.compat.torch_ao import NonFiniteBatchError
from quantscope.stats.histogram import binned_counts, linear_counts

INF = math.inf
_X = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))


def _pro(dtype="int8", symmetric=True):
    return quark.PerTensorHistogramObserverPro({"dtype": dtype, "qscheme": "per_tensor",
                                                "symmetric": symmetric,
                                                "round_method": "half_even"})


def _ao(dtype="int8", symmetric=True):
    """torch.ao's HistogramObserver as Quark's Pro builds it (its qparams are the Pro's)."""
    qmin, qmax = {"int8": (-128, 127), "uint8": (0, 255)}[dtype]
    return HistogramObserver(
        bins=256, dtype=torch.qint8 if dtype == "int8" else torch.quint8,
        qscheme=torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine,
        quant_min=qmin, quant_max=qmax)


def _ao_qparams(obs):
    return obs._calculate_qparams(*obs._non_linear_param_search())


def _with(value, *flat, base=_X):
    x = base.clone()
    x.view(-1)[list(flat)] = value
    return x


def _observe(obs, batches):
    """Feed ``batches``; the torch.ao warnings each one raised."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for b in batches:
            obs(b)
    return [str(w.message) for w in seen if "torch.inf detected" in str(w.message)]


_INF_CASES = {
    "inf": [_with(INF, 3)],
    "-inf": [_with(-INF, 3)],
    "both": [_with(INF, 3, 70).index_fill_(0, torch.tensor([5]), -INF)],
    "inf_later_inside": [_X, _with(INF, 9, base=_X * 0.5)],
    "inf_alone_first": [torch.full((4, 4), INF), _X],
}


@pytest.mark.parametrize("case", sorted(_INF_CASES))
@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("uint8", True),
                                              ("int8", False), ("uint8", False)])
def test_pro_drops_inf_as_torch_ao(case, dtype, symmetric):
    batches = _INF_CASES[case]
    ours, ref = _pro(dtype, symmetric), _ao(dtype, symmetric)
    warned = _observe(ours, batches)
    assert warned == _observe(ref, batches) and warned  # torch.ao's warning, once per batch
    scale, zp = ours.calculate_qparams()
    ref_scale, ref_zp = _ao_qparams(ref)
    assert torch.equal(scale, ref_scale) and torch.equal(zp.long(), ref_zp.long())


def test_pro_inf_batch_keeps_its_shape_and_tokens():
    plain, dropped = _pro(), _pro()
    plain(_X)
    _observe(dropped, [_with(INF, 3)])
    assert dropped.shape == plain.shape == (32, 64)
    assert int(dropped.observed_tokens) == int(plain.observed_tokens) == 32
    assert dropped._num_observed_tokens == plain._num_observed_tokens == 32


def test_pro_batch_of_inf_alone_observes_nothing():
    obs = _pro()
    assert _observe(obs, [torch.full((4, 4), INF), torch.tensor([-INF, INF])])
    assert not obs.has_observed
    with pytest.raises(ValueError, match="before any tensor"):  # torch.ao's: a NaN scale
        obs.calculate_qparams()


@pytest.mark.parametrize("first", [True, False])
def test_pro_nan_raises_in_forward_and_keeps_the_state(first):
    obs, clean = _pro(), _pro()
    if not first:
        obs(_X)
        clean(_X)
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    for bad in (_with(math.nan, 3), _with(math.nan, 3).index_fill_(0, torch.tensor([1]), INF)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no inf warning: aminmax gives NaN, as torch.ao's
            with pytest.raises(NonFiniteBatchError, match="NaN"):
                obs(bad)
        with pytest.raises(RuntimeError):  # torch.ao's histc error type
            obs(bad)
    after = obs.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    if first:
        assert not obs.has_observed
    else:
        for a, b in zip(obs.calculate_qparams(), clean.calculate_qparams(), strict=True):
            assert torch.equal(a, b)


def test_pro_non_finite_ignore_still_reads_zero():
    obs = quark.PerTensorHistogramObserverPro({"dtype": "int8", "qscheme": "per_tensor",
                                               "symmetric": True}, non_finite="ignore")
    bad = _with(math.nan, 3, 4).index_fill_(0, torch.tensor([1]), INF)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch.ao warning in forward: the native mode
        obs(bad)
    with pytest.warns(UserWarning, match=f"ignored {int((~bad.isfinite()).sum())} NaN / inf"):
        obs.calculate_qparams()


@pytest.mark.peers
@pytest.mark.xdist_group("quark")
@pytest.mark.parametrize("symmetric", [True, False])
def test_pro_non_finite_as_quark(symmetric):
    pytest.importorskip("quark.torch.quantization.observer.observer")
    from quark_twins import quark_twins
    cases = [v for k, v in sorted(_INF_CASES.items())]
    for batches in cases + [[torch.full((4, 4), INF)]]:
        theirs, ours = quark_twins("PerTensorHistogramObserverPro", dtype="int8",
                                   symmetric=symmetric)
        with contextlib.redirect_stdout(io.StringIO()):
            assert _observe(ours, batches) == _observe(theirs, batches)
            expected = theirs._calculate_qparams()
        if not ours.has_observed:  # inf alone: Quark's wrapper returns a NaN scale
            assert torch.isnan(expected[0]).all()
            continue
        got = ours._calculate_qparams()
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), batches
    for prefix in ([], [_X]):  # NaN: both raise in forward (Quark's: torch.histc's error)
        theirs, ours = quark_twins("PerTensorHistogramObserverPro", dtype="int8",
                                   symmetric=symmetric)
        for obs in (theirs, ours):
            for b in prefix:
                obs(b)
            with pytest.raises(RuntimeError, match="not finite"):
                obs(_with(math.nan, 3))


# ------------------------------------------------------------------ linear_counts
_X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.mark.skipif(not _X86, reason="torch.histc's bin of an inf position is ATen's int64 "
                                     "cast of inf (x86-64: bin 0; undefined elsewhere)")
@pytest.mark.parametrize("bins", [1, 7, 256, 2048, 4200])
@pytest.mark.parametrize("scale", [1e34, 1e35, 1e36, 1e37, 1e38, 3e38])
@pytest.mark.parametrize("counts", [linear_counts, binned_counts])
def test_linear_counts_overflowing_positions_equal_torch_histc(bins, scale, counts):
    g = torch.Generator().manual_seed(bins)
    x = torch.randn(4000, generator=g).mul_(scale).clamp_(-3.4e38, 3.4e38)
    # |x| from 0 (Quark's symmetric grid) and signed ranges whose width stays finite
    signed = x.clamp(-1.6e38, 1.6e38)
    for data, lo, hi in ((x.abs(), 0.0, float(x.abs().max())),
                         (signed, float(signed.min()), float(signed.max())),
                         (signed, float(signed.min()) / 2, float(signed.max()) / 3)):
        got = counts(data[None], torch.tensor([lo]), torch.tensor([hi]), bins)[0]
        assert torch.equal(got.float(), torch.histc(data, bins, lo, hi)), (lo, hi)


@pytest.mark.parametrize("bins", [1, 7, 256, 2048, 4200])
@pytest.mark.parametrize("binning", [linear_counts, binned_counts])
def test_linear_counts_ordinary_data_unchanged(bins, binning):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5000, generator=g) * torch.tensor([[1e-3], [10.0], [1e30]])
    x[:, :500] = x[:, :500].round()  # values on edges
    lo, hi = x.amin(1), x.amax(1)
    for a, b in ((lo, hi), (lo / 2, hi / 2), (lo * 0, hi)):
        got = binning(x, a, b, bins)
        for row, want_lo, want_hi, counts in zip(x, a.tolist(), b.tolist(), got, strict=True):
            assert torch.equal(counts.float(), torch.histc(row, bins, want_lo, want_hi))
