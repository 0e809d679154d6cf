"""A feature whose optional package is missing says what to install (found by probing a
minimal install: torch, numpy and the wheel): a bare ``No module named ...`` from deep in the
stack names neither the feature nor the extra. Absence is simulated with ``sys.modules[name] =
None`` (an import then fails) and, for the version check, no installed distribution."""

import importlib
import sys

import pytest

from quantscope import _versions


@pytest.fixture
def without(monkeypatch):
    def hide(*modules, dist=None):
        for name in modules:
            monkeypatch.setitem(sys.modules, name, None)
        if dist is not None:
            monkeypatch.setattr(_versions, "_installed", lambda d: None if d == dist else "99")
    return hide


def test_empty_model_and_the_cli_model_name_transformers(without, tmp_path):
    from quantscope.calibration.run.checkpoint import empty_model
    from quantscope.cli.running import check_text_config

    without("transformers", "transformers.models.auto", dist="transformers")
    with pytest.raises(ImportError, match=r"^empty_model needs transformers >= .*pip install"):
        empty_model(tmp_path)
    with pytest.raises(ImportError, match=r"^--model needs transformers >= .*pip install"):
        check_text_config(tmp_path, "causal-lm")


def test_check_names_safetensors(without, tmp_path):
    from quantscope.exporters.value_checks import read_tensor

    without("safetensors")
    with pytest.raises(ImportError, match=r"check needs safetensors: pip install "
                                          r"'quantscope\[model\]'"):
        read_tensor({"x.weight_scale": (tmp_path / "model.safetensors",)}, "x.weight_scale")


@pytest.mark.parametrize("module, hidden, says", [
    ("quantscope.integrations.torchao", "torchao.quantization.pt2e",
     r"needs torchao: pip install 'quantscope\[peers\]'"),
    ("quantscope.integrations.llmcompressor", "llmcompressor.observers",
     r"needs it \(with its compressed-tensors\): pip install llmcompressor"),
])
def test_the_integrations_name_their_peer(without, monkeypatch, module, hidden, says):
    without(hidden)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=says):
        importlib.import_module(module)


@pytest.mark.parametrize("module, hidden", [
    ("quantscope.integrations.torchao", "torchao.quantization.pt2e"),
    ("quantscope.integrations.llmcompressor", "llmcompressor.observers"),
])
def test_the_integrations_missing_peer_error_keeps_the_module_name(without, monkeypatch, module,
                                                                  hidden):
    """The integrations re-raise the ``ModuleNotFoundError`` with a message saying what to
    install; its ``name`` (the missing module, which tools such as optional-import guards
    read) must survive: the peer's module, or the package above it where that is missing."""
    without(hidden)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ModuleNotFoundError) as e:
        importlib.import_module(module)
    assert e.value.name and hidden.startswith(e.value.name), e.value.name


def _calibrated_mlp():
    import torch

    from quantscope import calibrate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 16)
    return calibrate(model, [x], "w8a8", progress=False), model, x


ONNX_EXTRA = r"needs the onnx extra .*pip install 'quantscope\[onnx\]'"


@pytest.mark.parametrize("hidden", [("onnx", "onnxruntime", "onnxscript"), ("onnxscript",)])
def test_onnx_export_names_the_onnx_extra(without, tmp_path, hidden):
    """The checks of the export read onnx's types, and torch.onnx's exporter needs
    onnxscript: either missing is the extra's message, not a bare ModuleNotFoundError nor
    torch.onnx's failure blamed on the model."""
    from quantscope import export

    if "onnx" not in hidden:
        pytest.importorskip("onnx")
    calib, model, x = _calibrated_mlp()
    without(*hidden)
    with pytest.raises(ImportError, match=ONNX_EXTRA):
        export(calib, model, tmp_path / "m.onnx", format="onnx", example_inputs=x)
    assert not (tmp_path / "m.onnx").exists()


def test_onnx_session_names_the_onnx_extra(without, tmp_path):
    from quantscope.exporters import onnx as qonnx

    without("onnxruntime")
    for run in (lambda: qonnx.session(tmp_path / "m.onnx"), qonnx.session_options):
        with pytest.raises(ImportError, match=ONNX_EXTRA):
            run()


def test_sequential_checkpoint_names_the_model_extra(without, tmp_path):
    """A checkpoint read block by block without safetensors: save / load's message."""
    import torch

    from quantscope import calibrate
    from quantscope.calibration import Sequential

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    without("safetensors", "safetensors.torch")
    with pytest.raises(ImportError, match=r"need safetensors: pip install 'quantscope\[model\]'"):
        calibrate(Blocks(), [torch.randn(4, 16)], "w8a8", progress=False,
                  sequential=Sequential(checkpoint=tmp_path, blocks="layers"))
