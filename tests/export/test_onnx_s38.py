"""ONNX export (probe s38): a weight-only Linear called twice ran as float MatMul (each call's
DQ read the first call's codes, and ORT fuses no shared DQ into MatMulNBits); a model over
protobuf's 2 GiB failed to serialize after the whole export; a calibrated weight also read
outside its Linear exported silently with the float weight there; and some spec refusals
came only after the (slow) trace. Each call now writes its own codes, the size and the specs
are refused up front (the size again, exactly, before serializing), and an outside read is
refused naming the layer."""

import os

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from quantscope import Block, Channel, Group, QuantSpec, Tensor, calibrate, export
from quantscope.calibration.recipe import Recipe, Role, Rule
from quantscope.exporters import onnx as qonnx


def _recipe(w=None, i=None):
    roles = {}
    if w is not None:
        roles["weight"] = Role(w, "minmax")
    if i is not None:
        roles["input"] = Role(i, "minmax")
    return Recipe(Rule(("Linear",), **roles))


def _ref(model, calib, x):
    with torch.no_grad(), calib.apply(model):
        return model(x).numpy()


class _Calls(nn.Module):
    def __init__(self, calls=2, width=64):
        super().__init__()
        self.a, self.calls = nn.Linear(width, width), calls

    def forward(self, x):
        for _ in range(self.calls):
            x = self.a(x)
        return x


@pytest.mark.parametrize("spec", [QuantSpec("int4", Group(32)), QuantSpec("int8", Channel(0))],
                         ids=["int4_group32", "int8_channel"])
def test_a_weight_only_linear_called_twice_runs_as_matmulnbits_at_both(tmp_path, spec):
    torch.manual_seed(0)
    model, x = _Calls().eval(), torch.randn(2, 4, 64)
    calib = calibrate(model, [x], _recipe(spec), progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    opt = tmp_path / "m.opt.onnx"
    sess = qonnx.session(path, threads=1, optimized_model_path=str(opt))
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    ref = _ref(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert qonnx.integer_kernel_counts(opt) == {"MatMulNBits": 2}


@pytest.mark.parametrize("inputs", [None, QuantSpec("int8")], ids=["weight_only", "w8a8"])
def test_a_linear_called_twice_with_a_weight_over_onnxscripts_fold_limit(tmp_path, inputs):
    # probe s40: over 8192 elements onnxscript leaves the shared Transpose(a.weight) a node,
    # and the MatMuls, reading no initializer, were refused as "no MatMul multiplying by the
    # layer's weight"
    import onnx

    torch.manual_seed(0)
    model, x = _Calls(width=128).eval(), torch.randn(2, 3, 128)
    calib = calibrate(model, [x], _recipe(QuantSpec("int8", Channel(0)), inputs),
                      progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    graph = onnx.load(path).graph
    assert not [n for n in graph.node if n.op_type == "Transpose"]  # nor its float weight:
    assert not [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT
                and list(t.dims) == [128, 128]]
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    ref = _ref(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(128, 128), nn.Linear(128, 128)

    def forward(self, x):
        for _ in range(2):
            x = self.b(self.a(x))
        return x


def test_an_uncalibrated_linear_called_twice_keeps_its_transpose(tmp_path):
    # its unfolded Transpose is still read (by its float MatMuls): only the calibrated
    # layer's goes
    torch.manual_seed(0)
    model, x = _Pair().eval(), torch.randn(2, 3, 128)
    recipe = Recipe(Rule(("re:^a$",), weight=Role(QuantSpec("int8", Channel(0)), "minmax")))
    calib = calibrate(model, [x], recipe, progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    ref = _ref(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.fixture
def no_trace(monkeypatch):
    def traced(*a, **k):
        raise AssertionError("the model was traced before the refusal")
    monkeypatch.setattr(qonnx, "_export_float", traced)


def test_a_model_over_the_protobuf_limit_is_refused_before_the_trace(tmp_path, monkeypatch,
                                                                     no_trace):
    """With external_data=False (s49: the default writes external data instead)."""
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 8)).eval()
    x = torch.randint(0, 1000, (2, 5))
    calib = calibrate(model, [x], _recipe(QuantSpec("int8", Channel(0))), progress=False)
    # 1000 x 64 float32 embedding + 64 x 8 int8 codes + 8 float32 biases
    monkeypatch.setattr(qonnx, "PROTOBUF_LIMIT", 256_000, raising=False)
    with pytest.raises(ValueError, match=r"take 256544 bytes \(0\.00 GiB, estimated") as e:
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x,
               external_data=False)
    assert "protobuf's 2 GiB limit" in str(e.value) and "external_data=False" in str(e.value)
    assert not (tmp_path / "m.onnx").exists()


def test_the_graphs_own_size_is_checked_before_it_is_serialized(tmp_path, monkeypatch):
    """A weight-only Linear called four times holds its codes four times: over a limit its
    parameters alone are under. Refused with external_data=False; by default (s49) written
    with external data, as the graph's size, not the estimate, decides."""
    torch.manual_seed(0)
    model, x = _Calls(4).eval(), torch.randn(2, 4, 64)
    calib = calibrate(model, [x], _recipe(QuantSpec("int8", Channel(0))), progress=False)
    # parameters: 4096 codes + 256 bias bytes; the graph: 4 x 4096 codes
    monkeypatch.setattr(qonnx, "PROTOBUF_LIMIT", 8000, raising=False)
    with pytest.raises(ValueError, match=r"GiB, in the graph\), over protobuf's 2 GiB limit"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x,
               external_data=False)
    assert not (tmp_path / "m.onnx").exists()
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert len(os.listdir(tmp_path)) == 2  # the model and its data file
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    ref = _ref(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


class _Sum(nn.Module):  # a read torch.onnx folds into a float constant
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)

    def forward(self, x):
        return self.a(x) + self.a.weight.sum(1)


class _Gate(nn.Module):  # a read that stays a node of the graph
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.a(self.b(x)) * (x @ self.a.weight.T)


@pytest.mark.parametrize("make", [_Sum, _Gate])
def test_a_weight_read_outside_its_linear_is_refused_naming_it(tmp_path, make):
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(4, 3, 16)
    calib = calibrate(model, [x], _recipe(QuantSpec("int4", Tensor())), progress=False)
    with pytest.raises(ValueError, match=r"a\.weight is also read outside a \(by a \w+ in "
                                         r"the model's own forward\).*float weight.*ignore"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert not (tmp_path / "m.onnx").exists()


def test_a_fault_of_the_read_check_is_not_called_an_exporter_failure(tmp_path, monkeypatch):
    # the check ran inside the trace's error handler: its own bug read "torch.onnx could not
    # export", hiding where it came from
    def broken(*_):
        raise KeyError("outside_reads")

    monkeypatch.setattr(qonnx, "outside_reads", broken)
    model, x = _Sum().eval(), torch.randn(4, 16)
    calib = calibrate(model, [x], _recipe(QuantSpec("int8", Channel(0))), progress=False)
    with pytest.raises(KeyError, match="outside_reads"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)


_REFUSED = {
    "block_weight": (QuantSpec("int8", Block(32)), None, {}, r"0\.weight: layout Block"),
    "g_idx_weight": (QuantSpec("int4", Group(16, g_idx=torch.arange(64).flip(0) // 16)), None,
                     {}, r"0\.weight: layout Group.*no g_idx"),
    "channel1_weight": (QuantSpec("int8", Channel(1)), None, {}, r"0\.weight: layout Channel"),
    "channel_input": (None, QuantSpec("int8", Channel(-1)), {}, r"0\.input: layout Channel"),
    "int4_input": (None, QuantSpec("int4", Tensor()), {}, r"0\.input: codes \[-8, 7\]"),
    "narrow_input": (None, QuantSpec("int8", Tensor(), quant_min=-127, quant_max=127), {},
                     r"0\.input: codes \[-127, 127\]"),
    "opset26": (QuantSpec("int8", Channel(0)), None, {"opset": 26}, r"at opset 26 records no"),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_specs_the_graph_cannot_hold_are_refused_before_the_trace(tmp_path, no_trace, case):
    w, i, kw, msg = _REFUSED[case]
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 32)).eval(), torch.randn(4, 3, 64)
    calib = calibrate(model, [x], _recipe(w, i), progress=False)
    with pytest.raises(ValueError, match=msg):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x, **kw)
    assert not (tmp_path / "m.onnx").exists()


# a 4-bit weight beside a 16-bit input: no MatMulIntegerToFloat to share the codes with, so
# each call writes its own (an int16 input is not an 8-bit one)
@pytest.mark.parametrize("w", [QuantSpec("int4", Group(32)), QuantSpec("int4", Channel(0))],
                         ids=["int4_group32", "int4_channel"])
def test_a_linear_called_twice_beside_an_int16_input_writes_its_codes_per_call(tmp_path, w):
    import onnx

    torch.manual_seed(0)
    model, x = _Calls().eval(), torch.randn(2, 4, 64)
    calib = calibrate(model, [x], _recipe(w, QuantSpec("int16", Tensor())), progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    dqs = [n for n in onnx.load(str(path)).graph.node
           if n.op_type == "DequantizeLinear" and n.output[0].endswith("weight_dq")]
    assert len(dqs) == 2 and len({n.input[0] for n in dqs}) == 2
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    ref = _ref(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


# the outside-read check is about a calibrated weight: an input-only layer's weight may be read
@pytest.mark.parametrize("make", [_Sum, _Gate])
def test_a_weight_read_outside_an_input_only_linear_exports(tmp_path, make):
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(4, 3, 16)
    calib = calibrate(model, [x], _recipe(i=QuantSpec("int8", Tensor())), progress=False)
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    ref = _ref(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_the_size_estimate_counts_a_bf16_models_float_tensors_as_float32():
    # a bf16 model is exported from a float32 copy: its float tensors take 4 bytes a value
    model = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    model = model.to(torch.bfloat16).eval()
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    calib = calibrate(model, [x], _recipe(QuantSpec("int8", Channel(0))), progress=False)
    assert sorted(calib.states) == ["0", "2"]
    codes = 16 * 8 + 8 * 4  # the two weights, one byte a value
    floats = 8 + 8 + 8 + 4  # the biases and the LayerNorm's weight and bias
    assert qonnx._estimated_bytes(model, calib.states) == codes + floats * 4


class _Branch(nn.Module):
    """``b`` always runs; ``a`` runs in a torch.cond branch (calibrated on the eager twin:
    calibrate's hooks do not trace under dynamo's cond)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.cond = nn.Linear(16, 16), nn.Linear(16, 16), False

    def forward(self, x):
        y = self.b(x)
        if not self.cond:
            return self.a(y) if y.sum() > 0 else y * 2
        return torch.cond(y.sum() > 0, lambda y: self.a(y), lambda y: y * 2, (y,))


def _branch_calibration(target):
    torch.manual_seed(0)
    model, x = _Branch().eval(), torch.randn(4, 16) + 1
    recipe = Recipe(Rule((target,), weight=Role(QuantSpec("int8", Channel(0)), "minmax")))
    calib = calibrate(model, [x], recipe, progress=False)
    model.cond = True
    return model, x, calib


def test_a_float_linear_in_a_cond_branch_keeps_its_weight(tmp_path):
    # probe s40: the branch's weight was dropped as unread (only the main graph's nodes were
    # looked at): onnx's checker failed on the file
    model, x, calib = _branch_calibration("re:^b$")
    path = export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    sess = qonnx.session(path, threads=1)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    ref = _ref(model, calib, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_calibrated_linear_in_a_cond_branch_is_refused_for_what_it_is(tmp_path):
    # probe s40: it was said to be read "outside a (by a Gemm in the model's own forward)"
    model, x, calib = _branch_calibration("re:^a$")
    with pytest.raises(ValueError, match=r"a\.weight is read by a Gemm in a control-flow "
                                         r"branch \(torch\.cond"):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert not (tmp_path / "m.onnx").exists()


def test_another_models_calibration_is_refused_naming_the_shapes(tmp_path, no_trace):
    # probe s40: same layer names, other shapes: the refusal came deep in the qparams check
    # ("scale has 8 values ... has 16 units"), naming neither the layer nor the cause
    torch.manual_seed(0)
    calib = calibrate(nn.Sequential(nn.Linear(16, 8)), [torch.randn(2, 16)],
                      _recipe(QuantSpec("int8", Channel(0))), progress=False)
    other = nn.Sequential(nn.Linear(8, 16)).eval()
    with pytest.raises(ValueError, match=r"0\.weight has shape \(16, 8\), but was calibrated "
                                         r"with shape \(8, 16\)"):
        export(calib, other, tmp_path / "m.onnx", format="onnx", example_inputs=torch.randn(2, 8))


def test_a_float_layers_weight_is_never_decoded(tmp_path, monkeypatch):
    # review s40: following Transposes decoded every MatMul's initializer, a float lm_head's
    # too (a copy of each float weight during the export); only calibrated layers' now
    import onnx.numpy_helper

    decoded, to_array = [], onnx.numpy_helper.to_array
    monkeypatch.setattr(onnx.numpy_helper, "to_array",
                        lambda t, *a, **k: decoded.append(t.name) or to_array(t, *a, **k))
    torch.manual_seed(0)
    model, x = _Pair().eval(), torch.randn(2, 128)
    recipe = Recipe(Rule(("re:^a$",), weight=Role(QuantSpec("int8", Channel(0)), "minmax")))
    calib = calibrate(model, [x], recipe, progress=False)
    export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert decoded and not any(name.startswith("b.") for name in decoded)
