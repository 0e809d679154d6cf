"""bench/bench_onnx.py's float model export (its fp32 baseline, and the input of ORT's own
``quantize_static``): quantscope's exporter given a calibration of no tensors. Export
refuses a plain dict since 5eadf9b3, which broke ``make bench`` at the onnx step until
8ddafd00; the bench's own call on a small model, run in ORT."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("quantscope_bench_onnx",
                                                      BENCH / "bench_onnx.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_the_float_export_runs_in_ort(tmp_path):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    bench = _load()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "fp32.onnx"
    bench.export_float(model, path, (x,))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model(x).numpy()
    assert abs(got - want).max() < 1e-5
