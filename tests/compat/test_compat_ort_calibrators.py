"""ONNX Runtime's MinMax calibrator as a peer: on the same activations, quantscope's
``static_minmax`` observer gives exactly the range ORT's ``MinMaxCalibrater`` records (both
the running min and max over every batch; ORT's ``moving_average`` off)."""

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
