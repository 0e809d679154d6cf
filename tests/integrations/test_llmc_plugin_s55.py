"""Fixes of the s55 review in the llm-compressor plugin (``quantscope_<name>``): a bad
``observer_kwargs`` value is refused in the recipe's words as an unknown key is, and an
observer whose state went to the meta device (``model_free_ptq``'s estimate) observes real
data afterwards, as llm-compressor's own do. Runs in the peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

llmc = pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_<name>)

torch.set_num_threads(1)

WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


@pytest.mark.parametrize("name, kwargs, error, said", [
    ("quantscope_histogram", {"bins": -1}, ValueError, "bins must be an integer in [16, "),
    ("quantscope_static_minmax", {"non_finite": "propagate"}, ValueError,
     "non_finite must be one of ('error', 'ignore'), got 'propagate'"),
    ("quantscope_minmax", {"averaging_constant": 2.0}, ValueError,
     "averaging_constant must be a finite number in (0, 1], got 2.0"),
    ("quantscope_mse", {"expand": 0.5}, ValueError, "expand value must be at least 1.0, got 0.5"),
    ("quantscope_static_minmax", {"bogus": 1}, TypeError, "unexpected keyword argument 'bogus'"),
])
def test_a_bad_observer_kwargs_value_names_the_observer_and_the_recipe(name, kwargs, error,
                                                                        said):
    # a ValueError of the quantscope observer's own checks named its class (L2HistogramObserver
    # for quantscope_histogram), neither the name the recipe wrote nor the recipe's fields
    args = QuantizationArgs(**WEIGHTS, observer_kwargs=kwargs)
    with pytest.raises(error) as e:
        Observer.load_from_registry(name, base_name="weight", args=args)
    text = str(e.value)
    assert type(e.value) is error
    assert text.startswith(f"observer {name} for weights {{num_bits: 8, type: int, "
                           f"symmetric: true, strategy: channel}} with observer_kwargs "
                           f"{kwargs}: "), text
    assert said in text  # the observer's own message after it
    assert isinstance(e.value.__cause__, error)  # chained, not hidden
