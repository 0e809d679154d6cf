"""A real ONNX export over protobuf's 2 GiB (s49): two float32 embeddings of 1.1 GB each (a
protobuf field holds < 2 GiB, so no one tensor may) and a W8A8 Linear, exported by a child
process with the default ``external_data=None``: the model and its data file, ONNX Runtime's
output equal to ``calib.apply(model)``'s, and the child's peak memory (VmHWM) under 8 GB:
the torch model and one copy of its tensors in the proto, never a third.

Marked ``memory`` and ``extended``: it writes 2.2 GB and needs ~6 GB of memory (5.7 GB
measured: torch.onnx's serialization holds the model, its proto copy and one tensor's bytes
at once; 8.8 GB before the export stopped copying the proto's tensors), so neither ``make
test`` nor ``make test-extended`` runs it; run it alone (25 s) with
``pytest -m memory tests/export/test_onnx_external_big.py``.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.memory, pytest.mark.extended]
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

ROWS, WIDTH = 270_000, 1024  # 1.106 GB per float32 embedding
CHILD = textwrap.dedent(f"""
    import json, os, sys, time
    import numpy as np, torch
    from torch import nn
    from quantscope import calibrate, export
    from quantscope.exporters import onnx as qonnx
    torch.set_num_threads(2)

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.e1, self.e2 = nn.Embedding({ROWS}, {WIDTH}), nn.Embedding({ROWS}, {WIDTH})
            self.lin = nn.Linear({WIDTH}, 256)

        def forward(self, ids):
            return self.lin(self.e1(ids) + self.e2(ids))

    torch.manual_seed(0)
    model = Big().eval()
    ids = [torch.randint(0, {ROWS}, (2, 8)) for _ in range(3)]
    calib = calibrate(model, ids, "w8a8", progress=False)
    start = time.perf_counter()
    path = export(calib, model, sys.argv[1], format="onnx", example_inputs=ids[0])
    took = time.perf_counter() - start
    sess = qonnx.session(path, threads=2)
    got = sess.run(None, {{sess.get_inputs()[0].name: ids[1].numpy()}})[0]
    with torch.no_grad(), calib.apply(model):
        ref = model(ids[1]).numpy()
    hwm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")]
    print(json.dumps({{"export_s": took, "maxrss_mb": hwm[0] / 1024,
                      "err": float(np.abs(got - ref).max() / np.abs(ref).max())}}))
""")


def test_a_model_over_2_gib_exports_with_external_data(tmp_path):
    path = tmp_path / "big.onnx"
    import quantscope  # the child imports the quantscope this process tests

    src = str(pathlib.Path(quantscope.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                         text=True, env=env, timeout=1200, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and names[0] == "big.onnx" and names[1].startswith("big.onnx."), names
    data = os.path.getsize(tmp_path / names[1])
    assert data > 2 ** 31 and os.path.getsize(path) < 2 ** 20, (data, os.path.getsize(path))
    assert result["err"] <= 1e-5, result
    assert result["maxrss_mb"] < 7000, result  # 5.7 GB measured: 2.4 x the model
