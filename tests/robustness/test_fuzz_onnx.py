"""Property test of ONNX export (issue 37): a random small MLP or conv stack, a random preset
and dtype either exports, loads in ONNX Runtime (:func:`qonnx.session`) and gives finite
outputs within the documented bound (docs/guide/deploy.md) of the fake-quant model, or is
refused with a documented error before anything is written.

Profiles, documented errors and the counts are fuzzing.py's (shared by every test_fuzz*.py);
an export takes about a second, so the ``ci`` profile runs a handful of cases.
"""

import itertools
import os
import shutil
import tempfile
import warnings

import fuzzing as base
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from quantscope import calibrate, export, presets
from quantscope.calibration.recipe import Recipe, Role, Rule, preset

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
from quantscope.exporters import onnx as qonnx

TEST = "onnx_export"
CASES = settings(base.FUZZ, max_examples=12 if base.PROFILE != "fuzz" else 150)
PRESETS = ["w8a8", "w4a8", "w4a16", "w4a16-asym", "w8a16", "w8a8-dynamic", "fp8", "nvfp4"]
#: docs/guide/deploy.md, "ONNX Runtime (CPU)": float32 to float rounding plus isolated
#: one-code flips of a static input; a bf16 / fp16 model within that dtype's rounding and the
#: flips it causes
BOUND = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@st.composite
def models(draw):
    """(model, example input shape) of a random small stack: Linear layers on 3-D input, or
    Conv2d layers (float: the recipes target Linear) then a Linear."""
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    widths = draw(st.lists(st.sampled_from([16, 32, 64, 128, 256]), min_size=2, max_size=4))
    act = draw(st.sampled_from([nn.ReLU, nn.GELU, nn.Tanh, nn.Identity]))
    if draw(st.booleans()):
        layers = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b, bias=draw(st.booleans())), act()]
        return nn.Sequential(*layers[:-1]), (2, draw(st.integers(1, 6)), widths[0])
    chans, side = draw(st.sampled_from([1, 3, 4])), draw(st.sampled_from([4, 6]))
    model = nn.Sequential(nn.Conv2d(chans, 4, 3, padding=1), act(), nn.Flatten(),
                          nn.Linear(4 * side * side, widths[-1]))
    return model, (2, chans, side, side)


def _recipe(name):
    if name == "w8a16":
        return Recipe(Rule(("Linear",), weight=Role(presets.INT8_PER_CHANNEL, "minmax")))
    return preset(name, "minmax")


@pytest.mark.extended  # a fuzzer (make fuzz runs it long)
@CASES
@given(model=models(), name=st.sampled_from(PRESETS),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_onnx_export_of_random_small_models(model, name, dtype, seed):
    (model, shape), g = model, torch.Generator().manual_seed(seed)
    model = model.eval().to(dtype)
    batches = [torch.randn(*shape, generator=g).to(dtype) for _ in range(2)]
    try:
        calib = calibrate(model, batches, _recipe(name), progress=False)
    except ValueError:  # a recipe the shapes cannot take (group 128): no export case
        return
    base.start(TEST)
    root = tempfile.mkdtemp(prefix="quantscope-fuzz-onnx-")
    try:
        _export_and_run(model, calib, batches[0], os.path.join(root, "m.onnx"),
                        torch.randn(3, *shape[1:], generator=g).to(dtype))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _export_and_run(model, calib, example, path, test):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export.export(calib, model, path, format="onnx", example_inputs=example)
    except base.DOCUMENTED as e:
        assert base.clear(e), f"unclear {type(e).__name__}: {e!r}"
        left = os.listdir(os.path.dirname(path))
        assert not left, f"a refused export wrote {left}"
        base.count(TEST, "clear_errors")
        return
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: test.float().numpy()})[0]
    with torch.no_grad(), calib.apply(model):
        ref = model(test).float().numpy()
    assert np.isfinite(got).all(), "ORT gave NaN / inf from finite input"
    assert got.shape == ref.shape
    err = np.abs(got - ref).max()
    assert err <= BOUND[test.dtype] * max(np.abs(ref).max(), 1e-6), (test.dtype, err)
    base.count(TEST, "ok")
