"""compat.modelopt, probe s22: integer input, percentile under 128 bins and its 0..100
range, ``_axis`` / ``_num_bits`` / ``_unsigned`` set after construction, 1-D ``axis=-1``,
``_calib_hist`` / ``_calib_bin_edges`` / ``_calib_amax``, NaN / inf refused at ``collect``,
``+0`` amaxes, meta input, ``num_bins`` from 2, ``unsigned=1`` and 0-d amaxes of kept size-1
axes; reference values here, ModelOpt's own classes in the ``peers`` tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantscope.compat.modelopt import HistogramCalibrator, MaxCalibrator

NAN, INF = float("nan"), float("inf")


def _mo():
    return pytest.importorskip("modelopt.torch.quantization.calib")


def _run(cal, *xs):
    for x in xs:
        cal.collect(x)
    return cal.compute_amax()


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    assert torch.equal(a, b) or (a.is_meta and b.is_meta)


# ------------------------------------------------------------------ reference values (.venv)
def test_integer_input_max_and_histogram():
    got = _run(MaxCalibrator(), torch.tensor([1, -7, 3]))
    assert got.dtype == torch.int64 and got.shape == () and int(got) == 7
    got = _run(MaxCalibrator(axis=0), torch.tensor([[1, -2], [5, 3]], dtype=torch.int16))
    assert got.dtype == torch.int16 and got.tolist() == [[2], [5]]
    # float32 rounds 2**31 - 1 up to 2**31: the top, not a wrapped negative
    top = torch.iinfo(torch.int32).max
    assert int(_run(MaxCalibrator(), torch.tensor([top, 5], dtype=torch.int32))) == top
    with pytest.raises(ValueError, match="-128"):  # |-128| does not fit int8
        MaxCalibrator().collect(torch.tensor([1, -128], dtype=torch.int8))
    ints, floats = HistogramCalibrator(), HistogramCalibrator()
    ints.collect(torch.arange(100))
    floats.collect(torch.arange(100.0))
    assert torch.equal(ints.hist_counts, floats.hist_counts)
    assert float(ints.compute_amax("percentile", percentile=90)) == pytest.approx(88.99365234375)


def test_percentile_needs_no_start_bin():
    cal = HistogramCalibrator(num_bins=64)
    cal.collect(torch.arange(100.0))
    assert float(cal.compute_amax("percentile", percentile=90)) == 88.171875  # ModelOpt 0.47's
    with pytest.raises(ValueError, match="start_bin"):  # entropy / mse keep the check
        cal.compute_amax("entropy")


def test_percentile_range_is_modelopts():
    cal = HistogramCalibrator()
    cal.collect(torch.arange(100.0))
    for bad in (-10, 100.5, NAN):
        with pytest.raises(ValueError, match=r"percentile.*range"):
            cal.compute_amax("percentile", percentile=bad)
    zero = cal.compute_amax("percentile", percentile=0)
    assert zero.dtype == torch.float32 and zero.shape == () and float(zero) == 0.0


def test_axis_num_bits_unsigned_set_after_construction():
    x = torch.arange(12.0).reshape(3, 4)
    cal = MaxCalibrator()
    cal._axis = 0
    assert _run(cal, x).tolist() == [[3.0], [7.0], [11.0]]
    cal._axis = (0,)  # the same axis (ModelOpt's block-quant path sets it every batch): kept
    assert cal.compute_amax().shape == (3, 1)
    cal._axis = None  # another axis: the per-channel state is not per tensor, start over
    assert cal.compute_amax() is None
    assert float(_run(cal, x)) == 11.0
    cal._num_bits, cal._unsigned = 4, 1
    assert cal.spec.format.name == "uint4" and cal._num_bits == 4 and cal._unsigned is True
    assert float(cal.compute_amax()) == 11.0  # the data stays (ModelOpt reads neither)
    with pytest.raises(ValueError, match="num_bits"):
        cal._num_bits = 40
    assert cal._num_bits == 4
    hist = HistogramCalibrator()
    hist.collect(x)
    hist._unsigned = True
    assert hist._unsigned is True and hist.compute_amax("entropy") is not None
    hist._axis = None
    with pytest.raises(NotImplementedError, match="per tensor"):
        hist._axis = 0
    assert hist._axis is None


def test_axis_minus_one_on_1d_and_kept_size_one_axes():
    assert float(_run(MaxCalibrator(axis=-1), torch.tensor([1.0, -4.0, 2.0]))) == 4.0
    got = _run(MaxCalibrator(axis=0), torch.ones(1, 6), torch.full((1, 1, 6), 2.0))
    assert got.shape == () and float(got) == 2.0  # both amaxes 0-d: no shape change
    with pytest.raises(RuntimeError, match="amax shape changed"):
        _run(MaxCalibrator(axis=0), torch.ones(1, 6), torch.ones(2, 6))


def test_calib_attributes():
    hist, mx = HistogramCalibrator(num_bins=4), MaxCalibrator()
    assert hist._calib_hist is None and hist._calib_bin_edges is None and mx._calib_amax is None
    hist.collect(torch.tensor([1, -4, 2]))
    mx.collect(torch.tensor([1.0, -4.0]))
    assert hist._calib_hist.dtype == torch.float32 and hist._calib_hist.tolist() == [0, 1, 1, 1]
    assert hist._calib_bin_edges.tolist() == [0, 1, 2, 3, 4]
    hist.collect(torch.tensor([7.5]))  # grows by bins of width 1
    assert hist._calib_hist.tolist() == [0, 1, 1, 1, 0, 0, 0, 1]
    assert hist._calib_bin_edges.tolist() == list(range(9))
    assert mx._calib_amax.tolist() == 4.0
    with pytest.raises(AttributeError):
        mx._calib_amax = torch.ones(())
    hist.reset()
    assert hist._calib_hist is None


def test_histogram_non_finite_refused_at_collect():
    for bad in (NAN, INF, -INF):
        with pytest.raises(RuntimeError, match="x holds"):  # a first batch: ModelOpt's histc
            HistogramCalibrator().collect(torch.tensor([1.0, bad]))
    cal = HistogramCalibrator()
    cal.collect(torch.arange(100.0))
    before = cal.compute_amax("percentile", percentile=90)
    for bad, err in ((INF, OverflowError), (-INF, OverflowError), (NAN, ValueError)):
        with pytest.raises(err, match="x holds"):
            cal.collect(torch.tensor([1.0, bad]))
    assert torch.equal(cal.compute_amax("percentile", percentile=90), before)  # untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_data_amax_is_plus_zero(dtype):
    for axis in (None, 0):
        amax = _run(MaxCalibrator(axis=axis), torch.zeros(3, 4, dtype=dtype))
        assert not torch.signbit(amax).any()
    hist = HistogramCalibrator()
    hist.collect(torch.zeros(4, dtype=dtype))
    for method in ("mse", "entropy", "percentile"):
        assert not torch.signbit(hist.compute_amax(method, start_bin=0))


def test_meta_input_gives_a_meta_amax():
    cal = MaxCalibrator(axis=0)
    got = _run(cal, torch.empty(3, 4, device="meta"))
    assert got.is_meta and got.shape == (3, 1) and got.dtype == torch.float32
    with pytest.raises(RuntimeError, match="reset"):
        cal.collect(torch.ones(3, 4))
    cal.reset()
    assert _run(cal, torch.ones(3, 4)).shape == (3, 1)
    got = _run(MaxCalibrator(axis=(0, 1)), torch.empty(3, 4, device="meta", dtype=torch.int32))
    assert got.is_meta and got.shape == () and got.dtype == torch.int32


def test_num_bins_from_two_and_unsigned_one():
    cal = HistogramCalibrator(num_bins=8)
    cal.collect(torch.arange(100.0))
    assert cal.hist_counts.shape == (1, 8)
    assert float(cal.compute_amax("percentile", percentile=50)) == pytest.approx(99 * 3 / 8)
    with pytest.raises(ValueError, match="num_bins"):
        HistogramCalibrator(num_bins=1)
    assert MaxCalibrator(unsigned=1)._unsigned is True
    assert HistogramCalibrator(unsigned=0)._unsigned is False
    for bad in (2, "yes", 0.5):
        with pytest.raises(TypeError, match="unsigned"):
            MaxCalibrator(unsigned=bad)


# --------------------------------------------------------------- ModelOpt (peers)
@pytest.mark.peers
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32,
                                   torch.int64])
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1), ()])
def test_integer_max_equals_modelopt(dtype, axis):
    mo = _mo()
    ref, ours = mo.MaxCalibrator(axis=axis, track_amax=True), \
        MaxCalibrator(axis=axis, track_amax=True)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randint(0 if dtype == torch.uint8 else -100, 100, (3, 4), generator=g)
        ref.collect(x.to(dtype))
        ours.collect(x.to(dtype))
    _same(ref.compute_amax(), ours.compute_amax())
    _same(ref._calib_amax, ours._calib_amax)
    for a, b in zip(ref.amaxs, ours.amaxs, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.peers
@pytest.mark.parametrize("num_bins", [2, 4, 8, 15, 19, 32, 64, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("skip_zeros", [False, True])
def test_calib_hist_and_edges_equal_modelopt_as_they_grow(num_bins, dtype, skip_zeros):
    mo = _mo()
    ref = mo.HistogramCalibrator(num_bins=num_bins, skip_zeros=skip_zeros)
    ours = HistogramCalibrator(num_bins=num_bins, skip_zeros=skip_zeros)
    g = torch.Generator().manual_seed(num_bins)
    for i in range(5):
        x = torch.relu(torch.randn(400, generator=g)) * (1 + 3 * i * torch.rand((), generator=g))
        x = (x * 50).round().to(dtype) if dtype == torch.int32 else x.to(dtype)
        ref.collect(x)
        ours.collect(x)
        _same(ref._calib_hist, ours._calib_hist)
        _same(ref._calib_bin_edges, ours._calib_bin_edges)
        hist = ref._calib_hist.int().numpy()
        cdf = np.cumsum(hist / hist.sum())
        for p in (0, 50, 90):  # where float64's cdf decides (the doc), skipped
            k = int(np.searchsorted(cdf, p / 100))
            if p and (k == len(cdf) or (k and abs(cdf[k - 1] - p / 100) < 1e-12)):
                continue
            a, b = ref.compute_amax("percentile", percentile=p), \
                ours.compute_amax("percentile", percentile=p)
            torch.testing.assert_close(b, a, rtol=1e-6, atol=0)


@pytest.mark.peers
def test_set_after_construction_and_shapes_equal_modelopt():
    mo = _mo()
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(4))
    for first, later in ((None, 0), (0, None), (None, (0, 2)), (1, -1)):
        ref, ours = mo.MaxCalibrator(axis=first), MaxCalibrator(axis=first)
        ref._axis = ours._axis = later
        _same(_run(ref, x, 2 * x), _run(ours, x, 2 * x))
    for axis, xs in ((-1, [torch.tensor([1.0, -4.0, 2.0])]),
                     (0, [torch.ones(1, 6), torch.full((1, 1, 6), 2.0)])):
        _same(_run(mo.MaxCalibrator(axis=axis), *xs), _run(MaxCalibrator(axis=axis), *xs))
    for axis, shape, dtype in ((0, (3, 4), torch.float32), (None, (3, 4), torch.bfloat16),
                               ((0, 1), (3, 4), torch.int32), (0, (1, 4), torch.float32)):
        meta = torch.empty(shape, device="meta", dtype=dtype)
        a, b = _run(mo.MaxCalibrator(axis=axis), meta), _run(MaxCalibrator(axis=axis), meta)
        assert a.is_meta and b.is_meta and a.shape == b.shape and a.dtype == b.dtype
    for dtype in (torch.float32, torch.bfloat16):
        zeros = torch.zeros(3, 4, dtype=dtype)
        for axis in (None, 0):
            _same(_run(mo.MaxCalibrator(axis=axis), zeros), _run(MaxCalibrator(axis=axis), zeros))
    ref, ours = mo.HistogramCalibrator(unsigned=1), HistogramCalibrator(unsigned=1)
    ref.collect(torch.zeros(8))
    ours.collect(torch.zeros(8))
    _same(ref.compute_amax("mse", start_bin=3), ours.compute_amax("mse", start_bin=3))


@pytest.mark.peers
def test_errors_equal_modelopts():
    mo = _mo()
    for bad in (NAN, INF):
        for cal in (mo.HistogramCalibrator(), HistogramCalibrator()):
            with pytest.raises(RuntimeError):
                cal.collect(torch.tensor([1.0, bad]))
    for cal in (mo.HistogramCalibrator(), HistogramCalibrator()):
        cal.collect(torch.arange(10.0))
        with pytest.raises(OverflowError):
            cal.collect(torch.tensor([1.0, INF]))
        with pytest.raises(ValueError, match="range"):
            cal.compute_amax("percentile", percentile=-10)
        assert float(cal.compute_amax("percentile", percentile=0)) == 0.0
    with pytest.raises(NotImplementedError):
        mo.HistogramCalibrator(axis=0)


def test_a_tensor_quantizer_with_our_calibrator_has_modelopt_state_keys():
    """Probe s24: ModelOpt's calibrators are plain objects, so a TensorQuantizer saves only
    its own keys; ours, a module, added ``_calibrator.*`` and strict loads failed both ways."""
    cfg = pytest.importorskip("modelopt.torch.quantization.config")
    qnn = pytest.importorskip("modelopt.torch.quantization.nn")
    theirs = qnn.TensorQuantizer(cfg.QuantizerAttributeConfig(num_bits=8, calibrator="max"))
    ours = qnn.TensorQuantizer(cfg.QuantizerAttributeConfig(
        num_bits=8, calibrator=(MaxCalibrator, (8, None, False), {})))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(13))
    for q in (theirs, ours):
        q.disable_quant()
        q.enable_calib()
        q(x)
        q.load_calib_amax()
        q.enable_quant()
        q.disable_calib()
    assert isinstance(ours._calibrator, MaxCalibrator)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) == ["_amax"]
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    assert torch.equal(ours._amax, theirs._amax)
    for cal in (MaxCalibrator(), HistogramCalibrator()):  # alone: no state, as ModelOpt's
        cal.collect(x)
        state = {n: b.clone() for n, b in cal.named_buffers()}
        assert cal.state_dict() == {}
        with pytest.raises(RuntimeError, match="Unexpected key"):
            cal.load_state_dict({"max_vals": torch.ones(1)})
        cal.load_state_dict({})  # nothing to load: the collected state stays, every buffer
        after = dict(cal.named_buffers())
        assert after.keys() == state.keys()
        assert all(torch.equal(after[n], b) for n, b in state.items())


def test_the_cached_grown_edge_follows_the_module_to_another_device():
    """Second reading: the kept last edge is a plain attribute, which ``Module.to`` does not
    move; the grown grid's top must be on the histogram's device after a move."""
    g = torch.Generator().manual_seed(12)
    c = HistogramCalibrator(num_bins=64)
    c.collect(torch.randn(500, generator=g))
    c.collect(5.0 * torch.randn(500, generator=g))  # grows the grid
    assert c._calib_hist.shape[0] > 64
    before = c._linear_top().clone()
    c.to("meta")
    top = c._linear_top()
    assert top.device == c.hist_hi.device == torch.device("meta")
    assert top.shape == before.shape
