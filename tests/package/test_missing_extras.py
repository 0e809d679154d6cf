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
    from quantscope.exporters.consistency import _read

    without("safetensors")
    with pytest.raises(ImportError, match=r"check needs safetensors: pip install "
                                          r"'quantscope\[model\]'"):
        _read({"x.weight_scale": (tmp_path / "model.safetensors",)}, "x.weight_scale")


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
