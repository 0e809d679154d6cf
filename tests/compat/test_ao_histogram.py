"""compat.torch_ao.HistogramObserver against torch.ao's own, state for state, over batches
whose ranges grow, shrink and stay; the C kernels of stats.ao_histogram against torch's ops."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import HistogramObserver as TorchHistogramObserver

from quantscope.compat.torch_ao import HistogramObserver
from quantscope.stats import ao_histogram, histogram

needs_kernel = pytest.mark.skipif(ao_histogram._kernel() is None, reason="no C kernel")


def _assert_same_state(ref, ours):
    assert torch.equal(ref.histogram, ours.histogram), (ref.histogram - ours.histogram).abs().max()
    assert torch.equal(ref.min_val, ours.min_val) and torch.equal(ref.max_val, ours.max_val)


def _assert_same_qparams(ref, ours):
    (rs, rz), (s, z) = ref.calculate_qparams(), ours.calculate_qparams()
    assert torch.equal(rs, s), (rs, s)
    assert torch.equal(rz.long(), z.long()), (rz, z)


def _batches(seed, n, scales, shifts, size):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(size, generator=g) * scales[i % len(scales)] + shifts[i % len(shifts)]
        if i % 3 == 2:
            x[: max(1, size // 1000)] *= 20  # an outlier that widens the range
        out.append(x)
    return out


_KWARGS = [{}, {"bins": 256}, {"bins": 64}, {"qscheme": torch.per_tensor_symmetric,
                                             "dtype": torch.qint8},
           {"reduce_range": True}, {"quant_min": 0, "quant_max": 15}, {"bins": 100}]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 7),
       scales=st.lists(st.floats(0.01, 50.0), min_size=1, max_size=7),
       shifts=st.lists(st.floats(-5.0, 5.0), min_size=1, max_size=3),
       size=st.sampled_from([1, 7, 300, 5000]), kw=st.sampled_from(_KWARGS))
def test_same_histogram_and_qparams_as_torch_ao_on_any_batch_sequence(seed, n, scales, shifts,
                                                                     size, kw):
    ref, ours = TorchHistogramObserver(**kw), HistogramObserver(**kw)
    for x in _batches(seed, n, scales, shifts, size):
        ref(x)
        ours(x)
        _assert_same_state(ref, ours)
    _assert_same_qparams(ref, ours)


@pytest.mark.parametrize("path", ["C", "generic"])
@pytest.mark.parametrize("order", ["growing", "shrinking", "mixed"])
def test_same_as_torch_ao_when_ranges_grow_shrink_or_alternate(order, path, monkeypatch):
    if path == "generic":  # the observers' generic pass (other devices, modes, no kernel)
        monkeypatch.setattr(ao_histogram, "observe", lambda *a, **k: None)
    scales = {"growing": [1.1 ** i for i in range(8)], "shrinking": [0.8 ** i for i in range(8)],
              "mixed": [1, 3, 0.5, 4, 4, 0.1, 9, 2]}[order]
    ref, ours = TorchHistogramObserver(), HistogramObserver()
    g = torch.Generator().manual_seed(5)
    for s in scales:
        x = torch.randn(64, 384, generator=g) * s
        ref(x)
        ours(x)
        _assert_same_state(ref, ours)
        _assert_same_qparams(ref, ours)


def test_the_issue_case_eight_batches_each_ten_percent_wider():
    g = torch.Generator().manual_seed(1)
    ref, ours = TorchHistogramObserver(), HistogramObserver()
    for i in range(8):
        x = torch.randn(64, 128, 384, generator=g) * 1.1 ** i
        ref(x)
        ours(x)
    _assert_same_state(ref, ours)
    _assert_same_qparams(ref, ours)


@pytest.mark.parametrize("first", [0.0, 2.5, -3.0])
def test_a_constant_first_batch_then_a_wider_one(first):
    ref, ours = TorchHistogramObserver(bins=128), HistogramObserver(bins=128)
    for x in (torch.full((10,), first), torch.full((3,), first), torch.randn(500) * 4,
              torch.full((5,), 100.0)):
        ref(x)
        ours(x)
        _assert_same_state(ref, ours)
    _assert_same_qparams(ref, ours)


def test_a_constant_first_batch_whose_value_histc_and_the_edges_bin_apart():
    """A one-value histogram (min == max) moves its total to the bin ``torch.histc`` puts that
    value in on the wider range (torch.ao bins its ``min_val``), never by the re-binning of
    a range (``linspace`` edges and ``bucketize``): at 1.0974154 of 20 bins over [0.6217065,
    3.7930999] histc's ``trunc((x - lo) * bins / (hi - lo))`` gives bin 2, the edges bin 3."""
    ref, ours = TorchHistogramObserver(bins=20), HistogramObserver(bins=20)
    for x in (torch.full((10,), 1.0974154472351074),
              torch.tensor([0.621706485748291, 3.793099880218506])):
        ref(x)
        ours(x)
        _assert_same_state(ref, ours)
    assert ours.histogram[2] == 10 and ours.histogram[3] == 0  # (the second batch: 0, 19)


def test_values_on_the_edges_and_a_non_contiguous_batch():
    ref, ours = TorchHistogramObserver(bins=50), HistogramObserver(bins=50)
    x = torch.linspace(-1, 1, 1001)  # many values on bin edges
    y = torch.linspace(-3, 2, 2001).reshape(-1, 3).t()  # strided
    for b in (x, y, x * 0.3, torch.tensor([2.0, -3.0])):
        ref(b)
        ours(b)
        _assert_same_state(ref, ours)
    _assert_same_qparams(ref, ours)


def test_reset_starts_a_new_histogram():
    ref, ours = TorchHistogramObserver(), HistogramObserver()
    ours(torch.randn(100) * 50)
    ours.reset()
    assert torch.equal(ours.histogram, torch.zeros(2048))
    x = torch.randn(1000)
    ref(x)
    ours(x)
    _assert_same_state(ref, ours)
    _assert_same_qparams(ref, ours)


def test_non_torch_ao_arguments_are_refused_as_torch_ao_refuses_them():
    for cls in (TorchHistogramObserver, HistogramObserver):
        with pytest.raises(TypeError, match="averaging_constant"):
            cls(averaging_constant=0.1)


# ------------------------------------------------------------------ kernels vs torch's ops
@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 3000), bins=st.integers(1, 3000),
       span=st.sampled_from([1e-6, 1.0, 1e3, 1e30]), inside=st.booleans())
def test_histc_kernel_equals_torch_histc(seed, n, bins, span, inside):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * span
    lo, hi = x.min(), x.max()
    if not inside:  # a range narrower than the data: values outside are not counted
        lo, hi = lo / 2, hi / 2
    x[: n // 4] = lo  # values on the edges
    x[n // 4: n // 2] = hi
    base = torch.rand(bins, generator=g) * 100
    for b in (None, base, base[None]):  # (a base of any shape of bins values: [1, bins])
        got = ao_histogram.histc(x, bins, lo, hi, b)
        want = ao_histogram.histc(x, bins, lo, hi, b, backend="torch")
        assert torch.equal(got, want) and got.shape == (bins,)
        for backend in (None, "torch"):  # into a given [1, bins], left whole
            out = torch.full((1, bins), float("nan"))
            assert ao_histogram.histc(x, bins, lo, hi, b, backend, out=out) is out
            assert torch.equal(out[0], want)


@needs_kernel
@pytest.mark.parametrize("n", [2, 3, 17, 40])
@pytest.mark.parametrize("lo, hi", [(1.0, 3.4028235e38), (-3.4028235e38, -1.0),
                                    (-1e38, 2e38), (0.0, 1.7e38)])
def test_histc_kernel_on_ranges_near_float32_max_equals_torch_histc(lo, hi, n):
    # (x - lo) * bins overflows to inf there; torch counts such values in bin 0 (the kernel
    # used to index out of bounds: a segmentation fault)
    x = torch.linspace(lo, hi, n, dtype=torch.float64).float()
    lo, hi = float(x[0]), float(x[-1])  # float32 values
    got = ao_histogram.histc(x, 2048, lo, hi, backend="kernel")
    assert torch.equal(got, torch.histc(x, 2048, min=lo, max=hi))
    ref, ours = TorchHistogramObserver(), HistogramObserver()
    for batch in (x, x[: n // 2 + 1] / 2):
        ref(batch)
        ours(batch)
        _assert_same_state(ref, ours)
    _assert_same_qparams(ref, ours)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 64])
def test_histc_kernel_split_over_threads_equals_torch_histc(threads):
    g = torch.Generator().manual_seed(threads)
    x = torch.randn(1_000_003, generator=g)  # up to 3 threads of 2**18 values
    x[-5:] = 40.0  # outside the range, in the last thread's share
    lo, hi = torch.tensor(-3.0), torch.tensor(3.5)
    got = ao_histogram.histc(x, 2048, lo, hi, threads=threads)
    assert torch.equal(got, torch.histc(x, 2048, min=-3.0, max=3.5))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bins=st.integers(1, 2048),
       grow=st.tuples(st.floats(0, 3), st.floats(0, 3)), scale=st.sampled_from([1e-3, 1., 1e6]))
def test_upscale_kernel_equals_torch_ops(seed, bins, grow, scale):
    g = torch.Generator().manual_seed(seed)
    hist = (torch.rand(bins, generator=g) ** 4 * 1000).round() / 16 * 3
    lo, hi = torch.tensor(-1.3 * scale), torch.tensor(0.7 * scale)
    nlo, nhi = lo - grow[0] * scale, hi + grow[1] * scale
    got = ao_histogram.upscale(hist, lo, hi, nlo, nhi)
    want = ao_histogram.upscale(hist, lo, hi, nlo, nhi, backend="torch")
    assert torch.equal(got, want)
    o = TorchHistogramObserver(bins=bins)  # the torch path is torch.ao's own
    assert torch.equal(want, o._upscale_histogram(hist, lo, hi, nlo, nhi))


@needs_kernel
@pytest.mark.parametrize("grow", [(0.0, 2.4e-7), (1e4, 1e4), (0.0, 5e3), (3.0, 0.0)])
def test_upscale_kernel_equals_torch_ops_on_a_tiny_or_a_vast_widening(grow):
    g = torch.Generator().manual_seed(11)
    hist = (torch.rand(2048, generator=g) * 500).round()
    lo, hi = torch.tensor(-1.0), torch.tensor(2.0)
    nlo, nhi = lo - grow[0], hi + grow[1]  # one ulp of 2.0 wider, or ten thousand ranges
    got = ao_histogram.upscale(hist, lo, hi, nlo, nhi)
    assert torch.equal(got, ao_histogram.upscale(hist, lo, hi, nlo, nhi, backend="torch"))
    assert got.sum() == pytest.approx(float(hist.sum()), rel=1e-6)


def test_torch_path_alone_equals_torch_ao():
    ref = TorchHistogramObserver(bins=512)
    hist, old = None, None
    g = torch.Generator().manual_seed(3)
    for s in (1.0, 2.0, 0.5, 7.0):
        x = torch.randn(4000, generator=g) * s
        ref(x)
        x_range = tuple(torch.aminmax(x)[i].item() for i in (0, 1))
        hist, *ends = ao_histogram.update(hist, old, x, x_range, 512, backend="torch")
        old = tuple(ends)
        assert torch.equal(hist, ref.histogram)
        assert old == (ref.min_val.item(), ref.max_val.item())


@needs_kernel
@pytest.mark.parametrize("case", ["random points", "a late fall", "falling edges"])
def test_upscale_kernel_on_unsorted_points_searches_as_torch_bucketize(case):
    g = torch.Generator().manual_seed(4)
    bins, rate = 64, ao_histogram.UPSAMPLE_RATE
    hist = torch.rand(bins, generator=g) * 50
    # the mid points are lin[i] + half a piece: with olo = ohi = 0 the half is 0, so lin
    # gives the points as they are
    mids = torch.randn(bins * rate + 1, generator=g) * 2
    bounds = torch.linspace(-1.5, 1.5, bins + 1)
    if case != "random points":  # rising points but one fall: torch's search all the same
        mids = mids.sort().values
        at = bins * rate - 40 if case == "a late fall" else 0
        mids[at] = mids[at + 1] + 0.5
    if case == "falling edges":
        bounds[10] = bounds[12]
    out = torch.empty(bins)
    ao_histogram._kernel().qs_ao_upscale(hist.data_ptr(), bins, rate, mids.data_ptr(), 0.0,
                                         0.0, bounds.data_ptr(), out.data_ptr())
    where = (torch.bucketize(mids[:-1], bounds, right=True) - 1).clamp(0, bins - 1)
    want = torch.bincount(where, weights=hist.repeat_interleave(rate) / rate, minlength=bins)
    assert torch.equal(out, want)


@needs_kernel
@pytest.mark.parametrize("n, threads", [(1, 1), (5, 1), (16, 1), (17, 1), (10007, 1),
                                        (800_003, 3)])
@pytest.mark.parametrize("case", ["plain", "nan", "inf", "zeros"])
def test_minmax_pass_equals_torch_aminmax(case, n, threads):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, generator=g)
    at = n - 1 - n // 7  # in the last 16-value tail, or the last thread's share
    if case == "nan":
        x[at] = float("nan")
    elif case == "inf":
        x[at] = float("inf")
    elif case == "zeros":
        x.abs_()
        x[at] = 0.0
    mm = torch.empty(2)
    ao_histogram._kernel().qs_ao_minmax(x.data_ptr(), n, mm.data_ptr(), threads)
    ref = torch.stack(torch.aminmax(x))
    assert torch.equal(mm, ref) or (mm.isnan().all() and ref.isnan().all())


@needs_kernel
def test_observe_returns_none_where_the_kernel_does_not_apply_and_leaves_out_non_finite():
    def state(bins=64):
        return torch.full((bins,), 7.0), torch.tensor([1.0]), torch.tensor([2.0])

    x = torch.randn(100)
    for bad_x in (x.double(), x[::2], x[:0]):  # nothing written
        hist, lo, hi = state()
        assert ao_histogram.observe(hist, lo, hi, bad_x, first=True) is None
        assert torch.equal(hist, state()[0]) and (lo.item(), hi.item()) == (1.0, 2.0)
    hist, lo, hi = state()
    assert ao_histogram.observe(hist, lo, hi, x, first=True) is True
    again = state()
    ao_histogram.observe(*again, x.clone().requires_grad_().reshape(4, 25), first=True)
    assert all(torch.equal(a, b) for a, b in zip(again, (hist, lo, hi)))  # any shape, grad or not
    ref = TorchHistogramObserver(bins=64)  # against torch.ao's first step
    ref(x)
    assert torch.equal(hist, ref.histogram) and (lo.item(), hi.item()) == (ref.min_val.item(),
                                                                           ref.max_val.item())
    versions = [t._version for t in (hist, lo, hi)]
    inside = x.clamp(lo.item(), hi.item())[:50] * 0.5
    assert ao_histogram.observe(hist, lo, hi, inside) is False  # the one-read pass
    ref(inside)
    assert torch.equal(hist, ref.histogram)
    assert all(t._version > v for t, v in zip((hist, lo, hi), versions))  # written in place
    for one_read in (True, False):  # NaN or inf (inside the range or not): the state stays
        for poison in (float("nan"), float("-inf"), 0.0):
            bad = inside.clone()
            bad[7] = poison
            bad[9] = float("nan") if poison == 0.0 else bad[9]
            kept = [t.clone() for t in (hist, lo, hi)]
            assert ao_histogram.observe(hist, lo, hi, bad, one_read=one_read) is \
                ao_histogram.NON_FINITE
            assert all(torch.equal(a, b) for a, b in zip(kept, (hist, lo, hi)))


def test_state_dict_round_trip_keeps_the_fractional_counts():
    ours = HistogramObserver(bins=128)
    for s in (1.0, 3.0):
        ours(torch.randn(1000) * s)
    assert not torch.equal(ours.histogram, ours.histogram.round())  # fractions after growth
    back = HistogramObserver(bins=128)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.histogram, ours.histogram)
    for a, b in zip(back.calculate_qparams(), ours.calculate_qparams()):
        assert torch.equal(a, b)
    # observing on from a loaded state (its tensors are not the ones the C path writes in
    # place: the generic pass sets them up) still follows torch.ao
    ref = TorchHistogramObserver(bins=128)
    ref(torch.ones(1))  # any batch: its state is then set to ours
    ref.histogram.copy_(ours.histogram)
    ref.min_val.copy_(ours.min_val)
    ref.max_val.copy_(ours.max_val)
    for s in (0.5, 4.0, 2.0):
        x = torch.randn(1000) * s
        ref(x)
        back(x)
        _assert_same_state(ref, back)


@needs_kernel
@pytest.mark.parametrize("n, threads", [(1, 1), (5, 1), (16, 1), (10007, 1), (800_003, 3)])
@pytest.mark.parametrize("case", ["inside", "outside", "nan", "inf", "edges"])
def test_fused_pass_equals_aminmax_and_histc(case, n, threads):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(n, generator=g)
    lo, hi = torch.tensor(-5.0), torch.tensor(6.0)
    at = n - 1 - n // 7  # in the last 16-value tail, or the last thread's share
    if case == "outside":
        x[at] = 7.0
    elif case == "nan":
        x[at] = float("nan")
    elif case == "inf":
        x[at] = float("-inf")
    elif case == "edges":
        x[: n // 3], x[n // 3: 2 * n // 3] = lo, hi
    base = torch.rand(300, generator=g)
    mm, hist = ao_histogram.fused(x, 300, lo, hi, base, threads=threads)
    mm = torch.tensor(mm)
    ref = torch.stack(torch.aminmax(x))
    assert torch.equal(mm, ref) or (mm.isnan().all() and ref.isnan().all())
    if case in ("inside", "edges"):
        assert torch.equal(hist, ao_histogram.histc(x, 300, lo, hi, base, backend="torch"))
    else:
        assert hist is None
    out = base.clone()  # into base itself: written on a hit, left as it was on a miss
    mm2, hist2 = ao_histogram.fused(x, 300, lo, hi, out, threads=threads, out=out)
    assert mm2 == tuple(mm.tolist()) or (mm.isnan().all() and torch.tensor(mm2).isnan().all())
    assert torch.equal(out, base if hist is None else hist) and (hist2 is None) == (hist is None)


def test_batches_inside_the_range_take_the_one_read_path_and_still_equal_torch_ao():
    ref, ours = TorchHistogramObserver(), HistogramObserver()
    g = torch.Generator().manual_seed(8)
    first = torch.randn(4000, generator=g) * 4
    batches = [first] + [torch.randn(4000, generator=g) * s for s in (1, 2, 5, 1, 0.5)]
    batches.insert(4, torch.full((3,), float("nan")))  # refused by both, poisons neither
    for x in batches:
        if x.isnan().any():
            for obs in (ref, ours):
                with pytest.raises(RuntimeError, match="not finite"):
                    obs(x)
        else:
            ref(x)
            ours(x)
        _assert_same_state(ref, ours)
    _assert_same_qparams(ref, ours)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("n", "bins", "chunk"), [(5000, 2048, None), (3001, 100, 1024),
                                                  (700, 7, 256)])
@pytest.mark.parametrize("ends", [(-2.0, 2.5), (0.1, 0.3), (1.5, 1.5)])
def test_ao_histc_on_cuda_is_torch_histc_of_the_float32_values(monkeypatch, device, dtype, n,
                                                                 bins, chunk, ends):
    """``quantscope::ao_histc``'s CUDA implementation (plain torch: run here on each device)
    is ``torch.histc`` of the float32 values (the last bin holds ``hi``, values outside
    ``[lo, hi]`` and NaN not counted; a degenerate span: the data's range, so the batch is
    binned at once), also where the batch is binned in chunks (``chunk``: a small one forced)
    whose counts are summed."""
    if chunk is not None:
        monkeypatch.setattr(histogram, "_HISTC_CHUNK", chunk)
    g = torch.Generator().manual_seed(n + bins)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), *ends[::-1], 1e-30])
    lo, hi = ends  # a value on each end, values beyond both
    edges = lo + torch.arange(bins + 1) * ((hi - lo) / bins)  # where rounding decides the bin
    edges = torch.cat((edges, edges.nextafter(torch.tensor(-9.0)), edges.nextafter(
        torch.tensor(9.0))))
    x = torch.cat((x, edges.to(dtype))).to(device)
    if lo == hi:  # torch.histc refuses non-finite data there
        x = x[x.isfinite()]
    want = torch.histc(x.float(), bins, min=lo, max=hi)
    got = ao_histogram._cuda_histc(x.reshape(-1, 3) if x.numel() % 3 == 0 else x, bins, lo, hi)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert ends != (-2.0, 2.5) or (want[-1] > 0 and want[0] > 0)  # values on both ends
