"""ONNX Runtime's calibrators as peers, on the same activations (a tiny MatMul -> Relu graph):
MinMax equals ``static_minmax`` (both the running min and max over every batch; ORT's
``moving_average`` off); Percentile equals quantscope's percentile estimator; Entropy at its
defaults and Distribution equal min-max ranges on one collection. Where they differ, and why:
the comments and docstrings below, and docs/benchmarks.md's onnx section."""

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
calibrate = pytest.importorskip("onnxruntime.quantization.calibrate")

from quantscope import presets
from quantscope.observers.registry import get_observer


def _tiny_graph(path):
    from onnx import TensorProto, helper, numpy_helper
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, 4])],
        [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10  # opset 21's; onnx's newest would refuse an older onnxruntime (Python 3.10's)
    onnx.save(onnx.shape_inference.infer_shapes(m), str(path))  # value_info for y
    return w


class _Reader(calibrate.CalibrationDataReader):
    def __init__(self, batches):
        self._it = iter(batches)

    def get_next(self):
        x = next(self._it, None)
        return None if x is None else {"x": x}


def test_static_minmax_equals_ort_minmax_calibrater(tmp_path):
    w = _tiny_graph(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((5, 8)) * (i + 1)).astype(np.float32) for i in range(4)]
    cal = calibrate.create_calibrator(str(tmp_path / "m.onnx"), ["MatMul", "Relu"],
                                      augmented_model_path=str(tmp_path / "aug.onnx"),
                                      calibrate_method=calibrate.CalibrationMethod.MinMax)
    cal.collect_data(_Reader(batches))
    ranges = cal.compute_data()
    for name, acts in (("x", batches), ("y", [b @ w for b in batches]),
                       ("z", [np.maximum(b @ w, 0) for b in batches])):
        obs = get_observer("static_minmax", presets.INT8_PER_TENSOR)
        for a in acts:
            obs(torch.from_numpy(a))
        lo, hi = obs.calculate_range()
        ort_lo, ort_hi = (float(np.asarray(v).reshape(())) for v in ranges[name].range_value)
        assert (float(lo), float(hi)) == (ort_lo, ort_hi), name


# ---- histogram calibrators -------------------------------------------------------------
# ORT's Percentile / Entropy / Distribution calibrators (onnxruntime/quantization/
# calibrate.py, HistogramCollector) histogram every sample of one ``collect_data`` call at
# once (``np.asarray`` of the list: samples must share a shape), with ``np.histogram``:
# Percentile (symmetric, its default) ``num_bins`` (2048) bins of ``|x|`` over
# ``[min |x|, max |x|]``; Entropy / Distribution ``num_bins`` (128 / 2048) bins of ``x`` over
# ``[-max |x|, max |x|]``. A further ``collect_data`` call (``CalibStridedMinMax``) whose max
# is larger appends bins of the first call's width (the bin count grows without bound);
# quantscope's histograms keep ``bins`` bins on a power-of-two grid (exact, order-free
# merges). So the histograms, hence the results, agree on ONE collection; across several
# they differ by up to a bin of either grid.


def _collect(tmp_path, method, batches, collections=1, **extra):
    cal = calibrate.create_calibrator(str(tmp_path / "m.onnx"), ["MatMul", "Relu"],
                                      augmented_model_path=str(tmp_path / f"{method}.onnx"),
                                      calibrate_method=getattr(calibrate.CalibrationMethod,
                                                               method),
                                      extra_options=extra)
    n = len(batches) // collections
    for c in range(collections):
        cal.collect_data(_Reader(batches[c * n:(c + 1) * n]))
    return cal


def _activations(tmp_path, scale=1.0):
    w = _tiny_graph(tmp_path / "m.onnx")
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((64, 8)) * scale * (1 + i % 3)).astype(np.float32)
               for i in range(4)]
    acts = {"x": batches, "y": [b @ w for b in batches], "z": [np.maximum(b @ w, 0)
                                                           for b in batches]}
    return batches, acts


def _ort_range(ranges, name):
    return tuple(float(np.asarray(v).reshape(())) for v in ranges[name].range_value)


@pytest.mark.parametrize("percentile", [99.9, 99.999])
def test_percentile_estimator_equals_ort_percentile_calibrater(tmp_path, percentile):
    """ORT's threshold is ``edges[searchsorted(cumsum(hist / total), p / 100)]``: the left edge
    of the first bin whose cumulative share reaches ``p`` percent, quantscope's
    ``convention="lower"``. On ORT's own ``|x|`` histogram quantscope's estimator gives the
    same threshold ``t``; ORT then clips ``(-t, t)`` to the signed data range
    ``(max(-t, min x), min(t, max x))``, an asymmetric range where quantscope's symmetric one
    stays ``+-t``."""
    from quantscope.estimators.percentile import percentile_range
    from quantscope.stats.histogram import Hist

    batches, acts = _activations(tmp_path)
    cal = _collect(tmp_path, "Percentile", batches, percentile=percentile)
    ranges = cal.compute_data()
    for name, a in acts.items():
        counts, edges = cal.collector.histogram_dict[name][:2]
        hist = Hist(torch.from_numpy(counts)[None], torch.tensor(edges[:1]),
                    torch.tensor(edges[-1:]), absolute=True)
        t = float(percentile_range(hist, percentile, symmetric=True, convention="lower")[1])
        x = np.stack(a)
        expect = (max(-t, float(x.min())), min(t, float(x.max())))
        assert _ort_range(ranges, name) == pytest.approx(expect, rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize("percentile", [99.9, 99.999])
def test_percentile_observer_equals_ort_where_the_grids_agree(tmp_path, percentile):
    """The ``percentile`` observer with ORT's bins (``grid="first"``: the first batch's
    ``[0, max |x|]`` in ``bins`` bins, ``convention="lower"``) equals ORT's Percentile
    calibrater on one collection where ``min |x| = 0`` (the ReLU output ``z``: ORT's grid
    ``[min |x|, max |x|]`` is then the same). Where ``min |x| > 0`` (``x``, ``y``) ORT's grid
    starts there: thresholds differ by less than one ORT bin plus ``min |x|``."""
    batches, acts = _activations(tmp_path)
    ranges = _collect(tmp_path, "Percentile", batches, percentile=percentile).compute_data()
    for name, a in acts.items():
        x = np.stack(a)
        obs = get_observer("percentile", presets.INT8_PER_TENSOR, percentile=percentile,
                           convention="lower", grid="first", bins=2048)
        obs(torch.from_numpy(x))
        t = float(obs.calculate_range()[1][0])
        expect = (max(-t, float(x.min())), min(t, float(x.max())))
        amin = float(np.abs(x).min())
        if amin == 0:
            assert _ort_range(ranges, name) == pytest.approx(expect, rel=1e-6), name
        else:
            tol = (float(np.abs(x).max()) - amin) / 2048 + amin
            assert np.allclose(_ort_range(ranges, name), expect, rtol=0, atol=tol), name


def test_entropy_calibrater_defaults_on_one_collection_are_min_max(tmp_path):
    """ORT's Entropy search tries thresholds ``i = num_quantized_bins / 2 .. num_bins / 2``
    bins either side of zero; at its defaults (128 bins, 128 quantized bins) on one collection
    that is the single candidate ``[-max |x|, max |x|]``, clipped to ``[min x, max x]``: the
    data's min / max, which ``static_minmax`` gives exactly. (With several collections the
    histogram grows and ORT runs its own KL search, which differs from quantscope's
    TensorRT entropy: a signed histogram, candidates symmetric in bins around zero, the
    outliers of both tails added to the end bins, merged bins of ``len // 128`` with the
    remainder in the last, expanded counts truncated to integers (``q`` is int64) and spread
    over the empty bins too, 1e-4 smoothing of zeros, float32 KL, the first minimum; TensorRT:
    an ``|x|`` histogram, ``h[0] = h[1]``, ``np.digitize`` groups, empty bins kept empty, no
    smoothing, float64, the last minimum. Documented in docs/benchmarks.md, not equal.)"""
    batches, acts = _activations(tmp_path)
    ranges = _collect(tmp_path, "Entropy", batches).compute_data()
    for name, a in acts.items():
        obs = get_observer("static_minmax", presets.INT8_PER_TENSOR)
        for b in a:
            obs(torch.from_numpy(b))
        lo, hi = obs.calculate_range()
        assert _ort_range(ranges, name) == (float(lo), float(hi)), name


def test_distribution_calibrater_on_one_collection_is_symmetric_min_max(tmp_path):
    """For integer types ``quantize_static`` reads the Distribution calibrater's range as its
    histogram's outer edges, ``+-max |x|`` on one collection: a symmetric min-max range,
    ``static_minmax``'s ``max |x|`` (on several collections the edges grow by whole bins of
    the first collection's width, so they end up to one such bin past ``max |x|``)."""
    from quantscope.qparams import amax_of_range

    batches, acts = _activations(tmp_path)
    ranges = _collect(tmp_path, "Distribution", batches).compute_data()
    for name, a in acts.items():
        obs = get_observer("static_minmax", presets.INT8_PER_TENSOR)
        for b in a:
            obs(torch.from_numpy(b))
        amax = float(amax_of_range(*obs.calculate_range())[0])
        assert _ort_range(ranges, name) == (-amax, amax), name
