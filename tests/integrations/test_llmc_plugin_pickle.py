"""The llm-compressor plugin's observer classes (``quantscope_<name>``, made one per native
name when the module is imported) pickle, as llm-compressor's own module-level classes do
(``torch.save`` of a module holding one, or a process pool, found no class by its name), and
say in their repr which quantscope observer they run. Runs in the peers' venv."""

from __future__ import annotations

import pickle

import pytest
import torch

pytestmark = pytest.mark.peers

llmc = pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

import quantscope.integrations.llmcompressor as qsl

torch.set_num_threads(1)


@pytest.mark.parametrize("name", qsl.observer_names())
def test_a_pickled_observer_goes_on_as_the_original(name):
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(16, 64, generator=g), 3 * torch.randn(16, 64, generator=g)
    observer = Observer.load_from_registry(name, base_name="weight", args=args)
    observer(first)
    copy = pickle.loads(pickle.dumps(observer))
    assert type(copy) is type(observer)
    assert getattr(qsl, type(observer).__name__) is type(observer)
    for o in (observer, copy):
        o(second)
    want, got = observer.get_qparams(), copy.get_qparams()
    assert want.keys() == got.keys() and want
    for key, value in want.items():
        assert (value is got[key] is None) or torch.equal(value, got[key]), key


@pytest.mark.parametrize("name", qsl.observer_names())
def test_the_repr_names_the_role_and_the_quantscope_observer(name):
    # a model printout or llm-compressor's log says which quantscope observer runs there
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32)
    observer = Observer.load_from_registry(name, base_name="weight", args=args)
    native = name.removeprefix("quantscope_")
    assert f"base_name='weight', quantscope='{native}'" in repr(observer), repr(observer)


def test_observers_pickle_after_the_module_is_imported_anew(monkeypatch):
    # a second import (sys.modules purged) registered nothing new, so its module held no
    # class: pickle, which looks a class up by its module's name, found none
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, qsl.__name__)  # (the first module back afterwards)
    again = importlib.import_module(qsl.__name__)
    assert again is not qsl
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    observer = Observer.load_from_registry("quantscope_mse", base_name="weight", args=args)
    observer(torch.randn(4, 16))
    assert type(pickle.loads(pickle.dumps(observer))) is type(observer)


@pytest.mark.parametrize("name", ["quantscope_static_minmax", "quantscope_mse",
                                  "quantscope_histogram"])
def test_the_state_dict_holds_nothing_as_llmcompressors_own(name):
    # the quantscope observer was a submodule: its buffers went into every model state_dict
    # taken mid-calibration (a strict load into a model with llm-compressor's observers
    # refused them), and a loaded observer said it held statistics but had no qparams shape
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")
    layer = torch.nn.Linear(64, 8)
    layer.register_module("input_observer",
                          Observer.load_from_registry(name, base_name="input", args=args))
    layer.input_observer(torch.randn(4, 64))
    assert list(layer.input_observer.state_dict()) == []
    theirs = torch.nn.Linear(64, 8)
    theirs.register_module("input_observer", Observer.load_from_registry(
        "static_minmax", base_name="input", args=args))
    theirs.load_state_dict(layer.state_dict(), strict=True)
    observer = layer.input_observer
    assert type(pickle.loads(pickle.dumps(observer)).quantscope) is type(observer.quantscope)
