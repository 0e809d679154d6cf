"""ONNX export of non-Linear layers (probe s34): a convolution, a GRU and a Bilinear were told
to "quantize the Linears inside a block, not the block", and a quantized Embedding passed the
up-front check to be refused only after tracing, with no word of what it is. Each is now
refused as a layer that is no Linear, before anything is traced or written; a block (no
weight of its own, its layers holding theirs) keeps the block hint."""

import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from quantscope import QuantSpec, calibrate, export
from quantscope.calibration import Recipe, Role, Rule
from quantscope.exporters import onnx as qonnx

W8 = Role(QuantSpec("int8", "channel"), "memoryless_minmax")
A8 = Role(QuantSpec("int8"), "minmax")


class _Wrap(nn.Module):
    def __init__(self, layer, pick=lambda y: y):
        super().__init__()
        self.layer, self.pick = layer, pick

    def forward(self, *x):
        return self.pick(self.layer(*x))


def _cases():
    torch.manual_seed(0)
    return {
        "Conv2d": (_Wrap(nn.Conv2d(4, 8, 3, groups=2, padding=1)), (torch.randn(2, 4, 5, 5),),
                   Rule(("Conv2d",), weight=W8, input=A8)),
        "GRU": (_Wrap(nn.GRU(8, 16, batch_first=True), lambda y: y[0]), (torch.randn(2, 5, 8),),
                Rule(("GRU",), input=A8)),  # an input role alone: its weights are not taken
        "Bilinear": (_Wrap(nn.Bilinear(6, 5, 4)), (torch.randn(3, 6), torch.randn(3, 5)),
                     Rule(("Bilinear",), weight=W8)),  # 3-D weight, one input refused
        "Embedding": (_Wrap(nn.Embedding(50, 16)), (torch.randint(0, 50, (4, 6)),),
                      Rule(("Embedding",), weight=W8)),
        "EmbeddingBag": (_Wrap(nn.EmbeddingBag(50, 16)), (torch.randint(0, 50, (4, 6)),),
                         Rule(("EmbeddingBag",), weight=W8)),
    }


@pytest.fixture
def no_trace(monkeypatch):
    def traced(*a, **k):
        raise AssertionError("the model was traced before the refusal")
    monkeypatch.setattr(qonnx, "_export_float", traced)


@pytest.mark.parametrize("kind", list(_cases()))
def test_a_layer_that_is_no_linear_is_refused_up_front_as_such(tmp_path, no_trace, kind):
    model, x, rule = _cases()[kind]
    model.eval()
    cal = calibrate(model, [x], Recipe((rule,)), progress=False)
    assert list(cal.states) == ["layer"]
    assert type(model.layer).__name__ == kind
    path = tmp_path / "m.onnx"
    with pytest.raises(ValueError) as e:
        export(cal, model, path, format="onnx", example_inputs=x)
    msg = str(e.value)
    assert f"layer 'layer' ({kind}): only Linear layers export to ONNX" in msg
    assert "ignore 'layer' in the recipe" in msg
    assert "block" not in msg
    assert not path.exists()


def test_a_block_keeps_the_block_hint(tmp_path, no_trace):
    torch.manual_seed(0)
    model = _Wrap(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))).eval()
    x = torch.randn(3, 8)
    cal = calibrate(model, [x], Recipe((Rule(("Sequential",), input=A8),)), progress=False)
    with pytest.raises(ValueError, match=r"layer 'layer' is a Sequential without a 2-D weight: "
                                         r"only Linear layers export \(quantize the Linears "
                                         r"inside a block, not the block\)"):
        export(cal, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)


@pytest.mark.parametrize("error", [MemoryError("out of memory"), OSError(28, "No space left")])
def test_the_machines_errors_are_not_wrapped_as_the_models(tmp_path, monkeypatch, error):
    """Found by fault injection (s35): a MemoryError or a disk-full OSError while torch.onnx
    ran was raised as a ValueError saying the model could not be traced."""
    torch.manual_seed(0)
    model = _Wrap(nn.Linear(8, 8)).eval()
    x = torch.randn(3, 8)
    cal = calibrate(model, [x], Recipe((Rule(("Linear",), weight=W8, input=A8),)),
                    progress=False)

    def fails(*a, **k):
        raise error
    monkeypatch.setattr(torch.onnx, "export", fails)
    with pytest.raises(type(error)):
        export(cal, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert not (tmp_path / "m.onnx").exists()
