"""A Linear called twice, exported to ONNX, runs in :func:`quantscope.exporters.onnx.session`
on an x86 CPU without VNNI too: there the session turns on ORT's precise u8u8 mode, whose
s8 -> u8 weight conversion refused two DequantizeLinear nodes reading one weight's codes
("Attempt to replace the existing tensor", onnxruntime 1.32; found on an AMD EPYC runner).
The session loads a copy with the codes unshared; the file keeps one copy of each weight."""

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from tiny_models import LinearTwice

from quantscope import calibrate, export
from quantscope.exporters import onnx as qonnx
from quantscope.exporters.onnx_tensors import unshared_codes


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = LinearTwice(16, 16).eval()
    g = torch.Generator().manual_seed(0)
    calib = calibrate(model, [torch.randn(3, 16, generator=g) * 4 for _ in range(4)], "w8a8",
                      progress=False)
    x = torch.randn(3, 16, generator=g) * 4
    path = tmp_path_factory.mktemp("onnx") / "m.onnx"
    export.export(calib, model, path, format="onnx", example_inputs=(x,))
    with torch.no_grad(), calib.apply(model):
        ref = model(x).numpy()
    return path, x, ref


@pytest.mark.parametrize("precise", [False, True], ids=["this_cpu", "u8u8"])
def test_a_linear_called_twice_runs_in_the_session(monkeypatch, exported, precise):
    """This CPU's session, and the precise mode of a CPU without VNNI (exact anywhere)."""
    path, x, ref = exported
    if precise:
        monkeypatch.setattr(qonnx, "int8_dot_product", lambda *a: False)
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_unshared_codes_copies_codes_and_zero_points_only(exported):
    path, _, _ = exported
    before = path.read_bytes()
    proto = onnx.load_from_string(unshared_codes(path))
    assert path.read_bytes() == before  # the file keeps one copy
    original = onnx.load(str(path)).graph
    dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    weights = [n for n in dqs if "input" not in n.input[0]]  # (not the inputs' QDQ)
    codes = [n.input[0] for n in weights]
    assert len(codes) == 3 and len(set(codes)) == 3  # a, a's second call, b
    inits = {t.name: t for t in proto.graph.initializer}
    first, second = (n for n in weights if n.input[1].startswith("a"))
    assert first.input[1] == second.input[1]  # the scale stays shared
    assert second.input[2] != first.input[2]
    for i in (0, 2):  # the copies hold the same values
        assert onnx.numpy_helper.to_array(inits[second.input[i]]).tobytes() == \
            onnx.numpy_helper.to_array(inits[first.input[i]]).tobytes()
    assert len(proto.graph.initializer) == len(original.initializer) + 2


def test_a_model_without_shared_codes_is_loaded_from_its_path(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    g = torch.Generator().manual_seed(1)
    calib = calibrate(model, [torch.randn(2, 8, generator=g) for _ in range(2)], "w8a8",
                      progress=False)
    path = tmp_path / "one.onnx"
    export.export(calib, model, path, format="onnx", example_inputs=(torch.randn(2, 8),))
    assert unshared_codes(path) == str(path)
