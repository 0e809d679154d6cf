"""The per-unit streaming histogram: exact bins, exact merges in any order, int64 counts."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantscope as qs
from quantscope.stats import histogram as H


def _observe(batches, bins, absolute):
    state = H.empty_state(batches[0].shape[0], bins)
    for u in batches:
        lo, hi = u.aminmax(dim=1)
        state = H.update(state, u, lo, hi, absolute)
    return state


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), units=st.integers(1, 4), n=st.integers(1, 4),
       bins=st.sampled_from([16, 64, 2048]), absolute=st.booleans())
def test_any_batch_order_and_merge_equal_one_batch(seed, units, n, bins, absolute):
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, generator=g) * 100
    batches = [torch.randn(units, int(torch.randint(1, 50, (1,), generator=g)), generator=g)
               * s + torch.randn(1, generator=g) for s in scales]
    one = _observe([torch.cat(batches, 1)], bins, absolute)
    for perm in itertools.islice(itertools.permutations(range(n)), 6):
        assert _same(_observe([batches[i] for i in perm], bins, absolute), one)
    k = max(1, n // 2)  # two "processes", merged
    second = _observe(batches[k:], bins, absolute) if batches[k:] else H.empty_state(units, bins)
    merged = H.merge(_observe(batches[:k], bins, absolute), second, absolute)
    assert _same(merged, one)
    assert torch.equal(one.counts.sum(1), torch.full((units,), sum(b.shape[1] for b in batches)))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), bins=st.sampled_from([16, 256, 2048]))
def test_bins_are_floor_of_x_over_width_and_the_grid_is_the_smallest(seed, bins):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(3, 200, generator=g) * torch.tensor([[1e-3], [1.0], [1e4]])
    u[1, :5] = 0.0
    s = _observe([u], bins, False)
    w = 2.0 ** s.exp.double()
    idx = torch.floor(u.double() / w[:, None]).long() - s.first[:, None]
    ref = torch.zeros_like(s.counts).scatter_add_(1, idx, torch.ones_like(idx))
    assert torch.equal(ref, s.counts)
    # the range (with zero) fits, and would not fit in bins of half the width
    lo, hi = u.min(1).values.clamp(max=0).double(), u.max(1).values.clamp(min=0).double()
    span = torch.floor(hi / w) - torch.floor(lo / w) + 1
    half = torch.floor(hi / (w / 2)) - torch.floor(lo / (w / 2)) + 1
    assert bool((span <= bins).all()) and bool((half > bins).all())


def test_rebin_is_exact_and_equals_direct_binning_on_the_coarser_grid():
    u = torch.randn(2, 1000) * 3
    s = _observe([u], 256, False)
    e2 = s.exp + 3
    f2 = H.grid_first(s.lo, e2, False)
    direct = torch.zeros_like(s.counts)
    H.add_values(direct, u, e2, f2)
    assert torch.equal(H.rebin(s.counts, s.exp, s.first, e2, f2), direct)


def test_int64_counts_go_past_2_pow_24():
    obs = qs.get_observer("percentile", qs.QuantSpec())
    x = torch.full((1 << 20,), 0.5)
    x[0] = 1.0
    for _ in range(17):
        obs(x)
    c = obs.current_histogram().counts
    assert c.dtype == torch.int64
    assert int(c.max()) == 17 * ((1 << 20) - 1) > 2**24  # float32 would stop at 2 ** 24
    assert int(c.sum()) == 17 << 20


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), bins=st.sampled_from([16, 100, 2048]),
       n=st.sampled_from([1, 7, 1000]), counts=st.sampled_from([H.linear_counts,
                                                                 H.binned_counts]))
def test_linear_counts_equal_torch_histc(seed, bins, n, counts):
    # linear_counts hands one float32 row to torch.histc; binned_counts is the emulation
    # every other case takes, held to histc here on the same rows
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10
    x[: n // 3] = torch.round(x[: n // 3])  # values on edges
    lo, hi = x.min(), x.max()
    got = counts(x[None], lo.reshape(1), hi.reshape(1), bins)[0]
    assert torch.equal(got.float(), torch.histc(x, bins, lo.item(), hi.item()))
    if lo == hi:  # histc then bins over the data's own range, which is this one
        return
    # a narrower grid drops values outside it, as histc does
    got = counts(x[None], (lo / 2).reshape(1), (hi / 2).reshape(1), bins)[0]
    assert torch.equal(got.float(), torch.histc(x, bins, (lo / 2).item(), (hi / 2).item()))


def test_linear_counts_takes_either_path_with_the_same_counts():
    g = torch.Generator().manual_seed(3)
    for rows in (1, 3, H._HISTC_ROWS, H._HISTC_ROWS + 1):  # histc row by row, then bincount
        x = torch.randn(rows, 999, generator=g) * torch.rand(rows, 1, generator=g) * 50
        x[:, :300] = x[:, :300].round()
        lo, hi = x.amin(1), x.amax(1)
        lo[0] = hi[0] = 2.0  # an empty range: histc's +-1 widening, by the emulation
        for a, b in ((lo, hi), (lo / 3, hi / 2)):
            want = H.binned_counts(x, a, b, 100)
            assert torch.equal(H.linear_counts(x, a, b, 100), want)
            assert torch.equal(H.linear_counts(x.double(), a, b, 100), H.binned_counts(
                x.double(), a, b, 100))


def test_linear_counts_exact_past_float32_counts(monkeypatch):
    # each histc chunk counts in float32, exact only up to 2 ** 24: chunks are summed in int64
    monkeypatch.setattr(H, "_HISTC_CHUNK", 1000)
    x = torch.full((1, 5000), 0.5)
    x[0, 0], x[0, 1] = -1.0, 1.0
    got = H.linear_counts(x, torch.tensor([-1.0]), torch.tensor([1.0]), 8)
    assert torch.equal(got, H.binned_counts(x, torch.tensor([-1.0]), torch.tensor([1.0]), 8))
    assert got.dtype == torch.int64 and int(got[0, 6]) == 4998


def test_linear_counts_of_a_real_row_past_2_24_in_one_bin():
    # the real chunk size and split: a float32 count stops at 2 ** 24 (2 ** 24 + 1 rounds
    # back to it), so one histc over the row, or chunks of 2 ** 25, would lose the last 3
    n = (1 << 24) + 3
    x = torch.full((1, n), 0.5)
    x[0, 0], x[0, 1] = -1.0, 1.0
    got = H.linear_counts(x, torch.tensor([-1.0]), torch.tensor([1.0]), 8)
    assert got.dtype == torch.int64
    assert got[0].tolist() == [1, 0, 0, 0, 0, 0, n - 2, 1]


def test_linear_counts_of_a_span_past_float32_take_the_emulation():
    # an infinite end (torch.histc raises on it) or finite float32 ends whose span
    # overflows (histc drops every value) go to binned_counts: each value inside the range
    # (x - lo) * bins / inf = 0 (or inf / inf, NaN) counts in the first bin, none is lost
    x = torch.tensor([[-3.0e38, -1.0e38, -1.0, 0.0, 0.5, 1.0e38, 3.0e38, 2.0]])
    for lo, hi, inside in ((-1.0, float("inf"), 6), (-3.2e38, 3.2e38, 8)):
        lo, hi = torch.tensor([lo]), torch.tensor([hi])
        got = H.linear_counts(x, lo, hi, 4)
        assert got.tolist() == [[inside, 0, 0, 0]]
        assert torch.equal(got, H.binned_counts(x, lo, hi, 4))


def test_fold_abs_matches_an_abs_histogram_off_the_edges():
    # seeded: a negative value exactly on a bin edge (~3 % of unseeded draws) folds one bin low
    u = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)) * 4 + 0.3
    signed = H.view(_observe([u], 512, False))
    e = _observe([u], 512, False).exp
    folded = H.fold_abs(signed)
    w = 2.0 ** e.double()
    ref = torch.zeros_like(folded.counts)
    ref.scatter_add_(1, torch.floor(u.abs().double() / w[:, None]).long().clamp(max=511),
                     torch.ones_like(u, dtype=torch.long))
    assert torch.equal(folded.counts, ref)  # no value sits exactly on an edge here
    assert torch.equal(folded.lo, torch.zeros(3))


@pytest.mark.parametrize("name", ["percentile", "histogram_mse", "entropy", "histogram", "mix"])
def test_state_dict_round_trip_and_reset(name):
    spec = qs.QuantSpec("int8", "channel:1", symmetric=name != "histogram")
    x = torch.randn(64, 8) * torch.arange(1, 9)
    a = qs.get_observer(name, spec, bins=256)
    a(x)
    b = qs.get_observer(name, spec, bins=256)
    b.load_state_dict(a.state_dict())
    qa, qb = a.calculate_qparams(), b.calculate_qparams()
    assert torch.equal(qa.scale, qb.scale) and torch.equal(qa.zero_point, qb.zero_point)
    b(x * 2)  # keeps observing from the loaded state
    a(x * 2)
    assert torch.equal(a.calculate_qparams().scale, b.calculate_qparams().scale)
    a.reset()
    assert not a.has_observed
    a(x)
    assert a.current_histogram().counts.sum() == x.numel()


@pytest.mark.parametrize("name", ["percentile", "histogram_mse", "entropy", "histogram", "mix"])
def test_observer_forward_has_no_host_sync_on_the_native_grid(name):
    obs = qs.get_observer(name, qs.QuantSpec("int8", "channel:0", symmetric=name != "mix"))
    x = torch.randn(4, 100)
    obs(x)
    with torch.autograd.profiler.profile() as prof:
        obs(x * 3)
    names = {e.name for e in prof.function_events}
    assert not names & {"aten::item", "aten::_local_scalar_dense"}


@pytest.mark.parametrize("name,kw", [(n, {}) for n in ("percentile", "histogram_mse", "entropy",
                                                          "histogram", "mix")]
                         + [("histogram", {"grid": "first"}), ("mix", {"averaging_constant": 0.1})])
def test_ranges_and_qparams_are_ordinary_tensors(name, kw):
    # estimates run under inference_mode: nothing of it may reach the caller or the state
    obs = qs.get_observer(name, qs.QuantSpec("int8", symmetric=False), **kw)
    x = torch.randn(4, 100)
    obs(x)
    lo, hi, qp = obs.range_and_qparams()
    for t in (lo, hi, qp.scale, qp.zero_point, *obs.buffers()):
        assert not t.is_inference()
    lo.add_(1)  # in place: refused on an inference tensor
    w = torch.ones(1, requires_grad=True)
    (w * qp.scale).sum().backward()  # saved for backward: refused too
    obs(x * 3)  # the (EMA) state takes the next batch in place


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="bins"):
        qs.get_observer("percentile", qs.QuantSpec(), bins=4)
    with pytest.raises(ValueError, match="averaging_constant"):
        qs.get_observer("percentile", qs.QuantSpec(), averaging_constant=2.0)
    with pytest.raises(ValueError, match="grid"):
        qs.get_observer("mix", qs.QuantSpec(), grid="linear")
    with pytest.raises(ValueError, match="percentile"):
        qs.get_observer("percentile", qs.QuantSpec(), percentile=0)
    with pytest.raises(ValueError, match="convention"):
        qs.get_observer("percentile", qs.QuantSpec(), convention="middle")
    with pytest.raises(ValueError, match="merge"):
        H.merge(H.empty_state(1, 16), H.empty_state(2, 16))
    # bounds of the wrong length: the kernel would read past them, so the search refuses
    from quantscope.estimators import histogram_mse_range
    from quantscope.estimators.l2 import l2_finalists

    obs = qs.get_observer("histogram", qs.QuantSpec("int8", "channel:0", symmetric=False))
    obs(torch.randn(3, 200))
    h, one = obs.current_histogram(), torch.zeros(1)
    with pytest.raises(ValueError, match=r"bounds must be \[3\]"):
        histogram_mse_range(h, obs.spec, bounds=(one - 1, one + 1))
    with pytest.raises(ValueError, match=r"bounds must be \[3\]"):
        l2_finalists(h, obs.spec, bounds=(one - 1, one + 1))


def test_numpy_reference_of_the_grid_exponent():
    # 2 ** e with e the smallest exponent whose aligned grid holds [lo, hi] in `bins` bins
    for lo, hi, bins in [(-1.0, 1.0, 16), (0.0, 100.0, 2048), (-3.5, 0.0, 64), (0.0, 0.0, 16)]:
        e = int(H.grid_exponent(torch.tensor([lo]), torch.tensor([hi]), bins))
        amax = max(abs(lo), abs(hi))
        # float32's 23 fraction bits below amax's exponent; an all-zero range has no floor
        floor_mag = np.frexp(amax)[1] - 1 - 22 if amax > 0 else -126
        ok = [k for k in range(-126, 127)
              if np.floor(hi / 2.0**k) - np.floor(lo / 2.0**k) + 1 <= bins and k >= floor_mag]
        assert e == ok[0]


def test_exact_histc_of_an_empty_float32_range_is_binned_at_once(monkeypatch):
    """Ends float32 cannot tell apart (1, 1 + 1e-12) are an empty range to histc, which then
    takes the data's range: chunk by chunk that range would differ (chunks forced small)."""
    monkeypatch.setattr(H, "_HISTC_CHUNK", 100)
    x = torch.linspace(-3, 5, 1000)
    want = torch.histc(x, 16, 1.0, 1.0 + 1e-12).long()
    calls, histc = [], torch.histc
    monkeypatch.setattr(torch, "histc", lambda *a, **k: calls.append(1) or histc(*a, **k))
    got = H.exact_histc(x, 16, 1.0, 1.0 + 1e-12)
    # (the CPU's histc compares the ends in float64, CUDA's in float32: one call either way)
    assert torch.equal(got, want) and len(calls) == 1


@pytest.mark.parametrize("refused", [False, True])
def test_exact_histc_in_chunks_or_where_histc_is_refused(monkeypatch, refused):
    """In chunks (forced small), and by the emulation where torch.histc raises (CUDA under
    deterministic algorithms: forced here), the counts are torch.histc's."""
    monkeypatch.setattr(H, "_HISTC_CHUNK", 100)
    monkeypatch.setattr(H, "_histc_refused", lambda x: refused)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1000, generator=g) * 2).bfloat16()
    x[:3] = torch.tensor([-1.5, 2.5, float("nan")])
    got = H.exact_histc(x, 40, -1.5, 2.5)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.histc(x.float(), 40, -1.5, 2.5).long())


_NAN, _INF, _BIG = float("nan"), float("inf"), 3.4028234663852886e38
_DATA = [-3.0, -1.0, 0.5, 2.0, 4.0, 7.0]


@pytest.mark.parametrize("x, lo, hi", [
    (_DATA, 0.0, 0.0), (_DATA, 3.0, 3.0), (_DATA, 0.5, 0.5), (_DATA, 1.0, 1.0 + 1e-12),
    ([2.5] * 5, 0.0, 0.0), ([2.5] * 5, 2.5, 2.5), ([0.0] * 3, 0.0, 0.0), ([0.0, 1e-45], 0.0, 0.0),
    # constants that +-1 does not move: histc widens them to their float32 neighbours
    ([1e9] * 3, 0.0, 0.0), ([-1e9] * 3, -1e9, -1e9), ([2.0**24] * 2, 0.0, 0.0),
    ([_BIG], 0.0, 0.0), ([-_BIG], 0.0, 0.0), ([], 0.0, 0.0), ([], 3.0, 3.0)])
@pytest.mark.parametrize("bins", [1, 4, 7])
def test_exact_histc_emulation_takes_histcs_range_where_lo_equals_hi(monkeypatch, x, lo, hi,
                                                                     bins):
    """Where torch.histc raises (CUDA under deterministic algorithms: forced here) an empty
    range is histc's too: the data's min and max (the documented ``0, 0``), of all chunks
    (forced small), widened where those are equal; each value in histc's bin."""
    monkeypatch.setattr(H, "_HISTC_CHUNK", 2)
    monkeypatch.setattr(H, "_histc_refused", lambda x: True)
    x = torch.tensor(x, dtype=torch.float32)
    # the ends compared in float32, as CUDA's histc compares them (the CPU's: in float64)
    want = torch.histc(x, bins, *torch.tensor([lo, hi]).tolist()).long()
    assert torch.equal(H.exact_histc(x, bins, lo, hi), want)
    if x.numel() and len(set(x.tolist())) == 1:  # a constant row's own range: the same bins
        assert torch.equal(H.binned_counts(x[None], x[:1], x[:1], bins)[0], want)


@pytest.mark.parametrize("x", [[_NAN, 1.0, 2.0], [1.0, 2.0, _NAN], [_INF, 1.0], [-_INF, 1.0],
                               [_INF], [_NAN]])
def test_exact_histc_emulation_refuses_a_data_range_that_is_not_finite(monkeypatch, x):
    # histc raises on NaN or an infinity in the data it takes the range from (lo == hi)
    monkeypatch.setattr(H, "_histc_refused", lambda x: True)
    x = torch.tensor(x)
    with pytest.raises(RuntimeError, match="is not finite"):
        torch.histc(x, 4, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="is not finite"):
        H.exact_histc(x, 4, 0.0, 0.0)
    # a range given: NaN dropped and infinities outside it, as histc does
    assert torch.equal(H.exact_histc(x, 4, -1.0, 3.0), torch.histc(x, 4, -1.0, 3.0).long())


def test_linear_counts_of_no_rows():
    empty = torch.zeros(0, 8)
    counts = H.linear_counts(empty, torch.zeros(0), torch.ones(0), 5)
    assert counts.shape == (0, 5) and counts.dtype == torch.int64
