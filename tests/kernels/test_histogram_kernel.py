"""The C histogram kernels equal the torch reference bitwise (stats.hist_kernel)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import quantscope as qs
from quantscope import kernels
from quantscope.stats import hist_kernel as HK
from quantscope.stats import histogram as H

pytestmark = pytest.mark.skipif(not kernels.available("hist_kernel"),
                                reason="no C compiler: torch path only")


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _data(g, shape, kind):
    """Values that stress the binning: spread, concentrated in a few bins (the register
    path), on bin edges, signed zeros, tiny values."""
    x = torch.randn(shape, generator=g)
    if kind == "concentrated":  # a few bins hold most values, outliers stretch the range
        x = x * 0.01
        x.view(-1)[:: 97] *= 3000
    elif kind == "edges":  # multiples of powers of two: exactly on bin edges
        x = torch.round(x * 64) / 16
        x.view(-1)[::5] = -0.0
        x.view(-1)[1::7] = 0.0
    elif kind == "tiny":
        x.view(-1)[::3] *= 1e-30
    return x


def _grid(g, U, B, lo, hi, absolute, shrink):
    """A grid for ``[lo, hi]``; ``shrink`` narrows it so values fall off both ends."""
    lo, hi = lo * shrink, hi * shrink
    s = H._update_grid(H.empty_state(U, B), lo, hi, absolute)
    return s.exp, s.first


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), U=st.sampled_from([1, 1, 3, 7]),
       E=st.sampled_from([5, 1000, 70_000]), B=st.sampled_from([16, 256, 2048]),
       absolute=st.booleans(), kind=st.sampled_from(["normal", "concentrated", "edges", "tiny"]),
       shrink=st.sampled_from([1.0, 0.5]), threads=st.sampled_from([1, 2]),
       prior=st.booleans())
def test_bin_values_equals_add_values_torch(seed, U, E, B, absolute, kind, shrink, threads,
                                            prior):
    g = torch.Generator().manual_seed(seed)
    if U * E > 200_000:
        E = 200_000 // U
    x = _data(g, (U, E), kind)
    lo, hi = x.aminmax(dim=1)
    exp, first = _grid(g, U, B, lo, hi, absolute, shrink)
    counts = torch.randint(0, 50, (U, B), generator=g) if prior else torch.zeros(U, B,
                                                                                 dtype=torch.int64)
    if prior and kind == "concentrated":  # counts that pick the register path's hot bins
        counts[:, B // 2 - 4: B // 2 + 4] += 10_000
    ref = H._add_values_torch(counts.clone(), x, exp, first, absolute)
    out = counts.clone()
    assert HK.bin_values(out, x, exp, first, absolute, threads=threads)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("U", [1, 3])
@pytest.mark.parametrize("hot_at", ["data", "elsewhere", "none"])
def test_bin_values_hot_bins_right_or_wrong_guess(U, hot_at):
    # the counts so far pick 16 bins counted in registers; a wrong pick must only cost time
    # (the kernel drops it after 16 blocks), never change a count
    g = torch.Generator().manual_seed(7)
    B = 256
    x = torch.randn(U, 60_000, generator=g) * 0.05
    x[:, ::101] *= 400
    lo, hi = x.aminmax(dim=1)
    exp, first = _grid(g, U, B, lo, hi, False, 1.0)
    counts = torch.zeros(U, B, dtype=torch.int64)
    zero = (-first)[:, None] + torch.arange(-8, 8)
    if hot_at == "data":
        counts.scatter_add_(1, zero, torch.full_like(zero, 100))
    elif hot_at == "elsewhere":
        counts[:, :16] = 100
    ref = H._add_values_torch(counts.clone(), x, exp, first, False)
    for threads in (1, 2):
        out = counts.clone()
        assert HK.bin_values(out, x, exp, first, False, threads=threads)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("absolute", [False, True])
def test_bin_values_non_finite_like_torch(absolute):
    # NaN to bin 0 (defined, so the torch path no longer indexes out of range), +-inf to the ends
    x = torch.randn(1, 100_000)
    x[0, ::1000] = float("nan")
    x[0, 1::1000] = float("inf")
    x[0, 2::1000] = -float("inf")
    exp, first = torch.tensor([-4]), torch.tensor([-60])
    ref = H._add_values_torch(torch.zeros(1, 128, dtype=torch.int64), x, exp, first, absolute)
    for threads in (1, 2):
        out = torch.zeros(1, 128, dtype=torch.int64)
        assert HK.bin_values(out, x, exp, first, absolute, threads=threads)
        assert torch.equal(out, ref)
    assert int(ref.sum()) == x.numel()


def test_bin_values_declines_what_it_does_not_handle_and_copies_strided_units():
    c = torch.zeros(2, 16, dtype=torch.int64)
    e, f = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    assert not HK.bin_values(c, torch.randn(2, 10, dtype=torch.float64), e, f, False)
    x = torch.randn(10, 2).t()  # not contiguous: binned from a copy
    assert HK.bin_values(c, x, e, f, False)
    assert torch.equal(c, H._add_values_torch(torch.zeros_like(c), x, e, f, False))
    assert not HK.bin_values(c.int(), torch.randn(1, 10), e, f, False)
    big = torch.zeros(1, HK.MAX_BINS + 1, dtype=torch.int64)  # scratch would be too large
    assert not HK.bin_values(big, torch.randn(1, 10), e[:1], f[:1], False)


def _ranges(g, U, n):
    """Batch ranges that grow, shrink, shift one end, span powers of two, hit zero."""
    out = []
    for _ in range(n):
        scale = torch.exp2(torch.randint(-30, 30, (U,), generator=g).float())
        lo = -torch.rand(U, generator=g) * scale
        hi = torch.rand(U, generator=g) * scale
        pick = torch.rand(U, generator=g)
        lo = torch.where(pick < 0.2, torch.zeros(U), lo)
        hi = torch.where(pick > 0.9, -lo * 2 ** 10, hi)  # exactly a power of two apart
        hi = torch.where((pick > 0.5) & (pick < 0.6), lo + 1e-6, hi)
        out.append((lo, hi))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), U=st.sampled_from([1, 5]),
       B=st.sampled_from([16, 17, 2048, 4096]), absolute=st.booleans())
def test_regrid_equals_the_torch_grid_change(seed, U, B, absolute):
    g = torch.Generator().manual_seed(seed)
    state = H.empty_state(U, B)
    for lo, hi in _ranges(g, U, 5):
        ref = H._update_grid(state, lo, hi, absolute)
        new = HK.regrid(state, lo, hi, absolute)
        assert new is not None and _same(new, ref)
        state = ref._replace(counts=ref.counts + torch.randint(0, 9, (U, B), generator=g))


def test_regrid_leaves_nan_and_inf_to_torch():
    state = H.empty_state(2, 64)
    for bad in (float("nan"), float("inf")):
        lo, hi = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, bad])
        assert HK.regrid(state, lo, hi, False) is None


def _batches(g, n, kind, E=50_000):
    out, scale, shift = [], 1.0, 0.0
    for i in range(n):
        x = _data(g, (1, E), kind) * scale + shift
        out.append(x)
        if kind == "shift":
            shift -= 0.7  # the negative end moves out, batch after batch
        scale *= [1.1, 0.5, 3.0, 1.0][i % 4]
    return out


def _unfused(state, x, absolute):
    lo, hi = torch.aminmax(x.reshape(-1))
    lo, hi = lo.reshape(1), hi.reshape(1)
    return H.update(state, x, lo, hi, absolute), lo, hi


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), B=st.sampled_from([16, 256, 2048]), absolute=st.booleans(),
       kind=st.sampled_from(["normal", "concentrated", "edges", "tiny", "shift"]),
       threads=st.sampled_from([1, 2]))
def test_fused_update_equals_minmax_then_update(seed, B, absolute, kind, threads):
    g = torch.Generator().manual_seed(seed)
    batches = _batches(g, 6, kind)
    state, _, _ = _unfused(H.empty_state(1, B), batches[0], absolute)
    hits = 0
    for x in batches[1:]:
        ref, lo, hi = _unfused(state, x, absolute)
        before = [t.clone() for t in state]
        ends = torch.empty(2)
        out = HK.fused_update(state, x, absolute, threads=threads, ends=ends)
        assert _same(state, before)  # never modified, hit or miss
        if out is not None:
            hits += 1
            new, flo, fhi = out
            assert _same(new, ref)
            assert torch.equal(flo, lo) and torch.equal(fhi, hi)
            assert torch.equal(ends, torch.cat([lo, hi]))
        state = ref
    if kind in ("normal", "concentrated"):
        assert hits >= 3  # the window holds growth by 3x: most batches fuse


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), B=st.sampled_from([16, 256, 2048]), absolute=st.booleans(),
       E=st.sampled_from([1, 7, 16, 100, 1000, 2048, 1535, 1536, 4095, 4096, 8191, 8192,
                          12287, 12288]),
       kind=st.sampled_from(["normal", "concentrated", "edges", "tiny", "shift"]))
def test_fused_update_of_short_batches_equals_minmax_then_update(seed, B, absolute, E, kind):
    """Below 2x its window's bins the fused pass counts straight into the window (no int32
    copies), above it through the copies: both equal the two passes (the window's bins that
    can hold counts are those of lo .. hi, max |x| for |x|: the bounds on both sides)."""
    g = torch.Generator().manual_seed(seed)
    batches = _batches(g, 7, kind, E=E)
    state, _, _ = _unfused(H.empty_state(1, B), batches[0], absolute)
    hits = 0
    for x in batches[1:]:
        ref, lo, hi = _unfused(state, x, absolute)
        ends = torch.empty(2)
        out = HK.fused_update(state, x, absolute, ends=ends)
        if out is not None:
            hits += 1
            assert _same(out[0], ref)
            assert torch.equal(out[1], lo) and torch.equal(out[2], hi)
            assert torch.equal(ends, torch.cat([lo, hi]))
        state = ref
    if kind == "normal" and E >= 100:
        assert hits >= 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("absolute", [False, True])
def test_fused_update_reads_half_batches_as_their_float32_values(dtype, absolute, monkeypatch):
    """A bf16 / fp16 batch of one piece (HALF_PIECE values) at most is read in one fused pass
    over its float32 copy, equal to the two passes over its values; a larger one is left to
    the two passes (which widen a piece at a time)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3000, generator=g)
    state, _, _ = _unfused(H.empty_state(1, 2048), x, absolute)
    for scale in (0.5, 1.0, 1.2):  # inside the fused pass's window
        half = (torch.randn(1, 3000, generator=g) * scale).to(dtype)
        half[0, :3] = torch.tensor([0.0, -0.0, 1e-7])
        ref, lo, hi = _unfused(state, half.float(), absolute)
        out = HK.fused_update(state, half, absolute)
        assert out is not None
        assert _same(out[0], ref) and torch.equal(out[1], lo) and torch.equal(out[2], hi)
        state = ref
    monkeypatch.setattr(HK, "HALF_PIECE", 2999)
    assert HK.fused_update(state, half, absolute) is None


def test_fused_update_misses_leave_the_unfused_path():
    state, _, _ = _unfused(H.empty_state(1, 256), torch.randn(1, 10_000), False)
    assert HK.fused_update(state, torch.randn(1, 10_000) * 100, False) is None  # off the window
    x = torch.randn(1, 10_000)
    x[0, 5] = float("nan")
    assert HK.fused_update(state, x, False) is None
    assert HK.fused_update(H.empty_state(1, 256), torch.randn(1, 10_000), False) is None  # small
    x = torch.randn(1, 100_000)
    x[0, 50_000] = 1e4  # far outside the range of the sample that picks a first batch's window
    assert HK.fused_update(H.empty_state(1, 256), x, False) is None


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), B=st.sampled_from([16, 2048]), absolute=st.booleans(),
       kind=st.sampled_from(["normal", "concentrated", "edges", "shift"]),
       threads=st.sampled_from([1, 2]))
def test_fused_first_batch_equals_minmax_then_update(seed, B, absolute, kind, threads):
    g = torch.Generator().manual_seed(seed)
    x = _data(g, (1, 100_000), kind if kind != "shift" else "normal")
    if kind == "shift":
        x = x * 0.1 - 7.0  # all negative, far from zero
    ref, lo, hi = _unfused(H.empty_state(1, B), x, absolute)
    out = HK.fused_update(H.empty_state(1, B), x, absolute, threads=threads)
    assert out is not None  # the sample's range holds these batches' within 4x
    assert _same(out[0], ref) and torch.equal(out[1], lo) and torch.equal(out[2], hi)


def test_fused_update_declines_a_tiny_negative_the_torch_path_bins_as_zero():
    # x * 2**-e is the smallest subnormal (bin -1), but at the new exponent e + 1 it rounds
    # to -0, which the torch path bins at 0: the window's bin -1 would merge to -1
    state, _, _ = _unfused(H.empty_state(1, 16), torch.tensor([[-1000.0, 1000.0]]), False)
    e = int(state.exp)
    x = torch.tensor([[-1.5 * 2.0 ** (e - 150), -2000.0, 2000.0]])
    assert float(x[0, 0] * 2.0 ** -e) != 0 and float(x[0, 0] * 2.0 ** -(e + 1)) == 0
    ref, _, _ = _unfused(state, x, False)
    assert int(ref.exp) == e + 1
    out = HK.fused_update(state, x, False)
    assert out is None or _same(out[0], ref)
    assert HK.fused_update(state, x.abs(), False) is not None  # no negative: fused


def _observe(make, batches, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(HK, "_kernel", lambda: None)
    o = make()
    for b in batches:
        o(b)
    monkeypatch.undo()
    return o


OBSERVERS = {
    "signed": lambda: qs.get_observer("histogram", qs.QuantSpec("uint8", symmetric=False)),
    "abs": lambda: qs.get_observer("entropy", qs.QuantSpec()),
    "skip_zeros": lambda: qs.get_observer("percentile", qs.QuantSpec(), skip_zeros=True),
    "ema": lambda: qs.get_observer("percentile", qs.QuantSpec("uint8", symmetric=False),
                                   averaging_constant=0.1, update_interval=2),
    "channel": lambda: qs.get_observer("percentile", qs.QuantSpec("int8", qs.Channel(0))),
    "channel_last": lambda: qs.get_observer(  # strided units: copied once in forward
        "histogram_mse", qs.QuantSpec("int8", qs.Channel(-1)), bins=64),
    "ignore": lambda: qs.get_observer("histogram", qs.QuantSpec("uint8", symmetric=False),
                                      non_finite="ignore"),
}


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_observers_equal_with_and_without_kernels(name, monkeypatch):
    g = torch.Generator().manual_seed(3)
    batches = [_data(g, (8, 4096), "concentrated") * s for s in (1.0, 1.1, 1.3, 0.7, 5.0, 1.0)]
    if name == "ignore":
        batches[2][0, :3] = float("nan")
        batches[3][1, 5] = float("inf")
    ours = _observe(OBSERVERS[name], batches, True, monkeypatch)
    ref = _observe(OBSERVERS[name], batches, False, monkeypatch)
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    assert torch.equal(torch.stack(ours.calculate_range()), torch.stack(ref.calculate_range()))


def test_nan_input_is_recorded_not_a_crash(monkeypatch):
    x = torch.randn(64, 1024)
    y = x.clone()
    y[3, 7] = float("nan")
    for kernel in (True, False):
        o = _observe(OBSERVERS["signed"], [x, y, x], kernel, monkeypatch)
        with pytest.raises(ValueError, match="NaN or inf"):
            o.calculate_qparams()


@pytest.mark.parametrize("cached", [False, True], ids=["general", "cached"])
def test_fused_forward_reads_nothing_back(forbid_host_sync, monkeypatch, cached):
    """The fused pass, through fused_update (the general forward) or the cached step's own
    call of the same C function (observers/hist_step.py), reads nothing back."""
    o = OBSERVERS["signed"]()
    o.cached_cpu_step = cached
    xs = [torch.randn(64, 1024) * s for s in (1.0, 1.2, 1.5)]
    o(xs[0])
    calls = []
    real = HK.fused_update

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(HK, "fused_update", spy)
    forbid_host_sync()
    for x in xs[1:]:
        o(x)
    if cached:
        assert not calls and "_hist_plans" in o.__dict__
    else:
        assert calls and all(calls)


def _torch_path(state, x, absolute, monkeypatch):
    """:func:`_unfused` with the C kernels off: the torch reference alone."""
    with monkeypatch.context() as m:
        m.setattr(HK, "_kernel", lambda: None)
        return _unfused(state, x.float(), absolute)


def _fused_equals_torch(state, x, absolute, monkeypatch):
    """The fused pass on one thread and on two hits and gives the torch reference's state,
    min / max and ends bit for bit; the reference's state."""
    ref, lo, hi = _torch_path(state, x, absolute, monkeypatch)
    for threads in (1, 2):
        ends = torch.empty(2)
        out = HK.fused_update(state, x, absolute, threads=threads, ends=ends)
        assert out is not None, threads  # a hit: the path under test ran
        assert _same(out[0], ref) and torch.equal(out[1], lo) and torch.equal(out[2], hi)
        assert torch.equal(ends, torch.cat([lo, hi]))
    return ref


@pytest.mark.parametrize("B, absolute", [(16384, False), (32768, True)])
def test_fused_direct_count_split_over_threads(B, absolute, monkeypatch):
    """70001 values: split over threads (65536 and more), each span counted straight into its
    own int64 window (fewer than 2x the window's 3B, |x|: 2B, bins), the windows then summed:
    only B >= 10923 (|x|: 16385) leaves such a batch under 2x its window (review s50 h: no
    other test reached it)."""
    g = torch.Generator().manual_seed(3)
    n = 70_001
    state, _, _ = _torch_path(H.empty_state(1, B), torch.randn(1, n, generator=g), absolute,
                              monkeypatch)
    for scale, kind, dtype in ((0.3, "normal", torch.float32), (0.3, "edges", torch.float32),
                               (1.0, "normal", torch.bfloat16), (-1.2, "tiny", torch.float32)):
        x = (_data(g, (1, n), kind) * scale).to(dtype)
        state = _fused_equals_torch(state, x, absolute, monkeypatch)


@pytest.mark.parametrize("B, absolute, n", [
    (2048, False, 30_000),  # a first batch's window: 8B bins (|x|: 4B), direct below 2x
    (4096, True, 30_000),
    (8192, False, 70_001),  # and split over threads
])
def test_fused_first_batch_direct_count(B, absolute, n, monkeypatch):
    """An empty state's fused pass (16K values and more) on fewer values than 2x its window's
    bins: counted straight into the window, as a sized state's short batch is (no other test
    reached it: the observers' tests use 2048 bins and the first-batch test 100000 values)."""
    g = torch.Generator().manual_seed(4)
    for kind, dtype in (("normal", torch.float32), ("edges", torch.float32),
                        ("normal", torch.bfloat16)):
        x = _data(g, (1, n), kind).to(dtype)
        _fused_equals_torch(H.empty_state(1, B), x, absolute, monkeypatch)
