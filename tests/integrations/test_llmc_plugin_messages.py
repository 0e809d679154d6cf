"""The llm-compressor plugin's errors quote the recipe's args as a recipe writes them
(``integrations.llmcompressor.recipe_args``): a block scheme's ``block_structure`` named (two
block schemes told apart), a field the recipe left unset left out (not ``group_size: None``,
which a recipe cannot hold). Pins mutants IN08 and IN11 of mutation round s55. Runs in the
peers' venv."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.peers

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

from quantscope.integrations.llmcompressor import recipe_args


@pytest.mark.parametrize("args, base_name, text", [
    (QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
     "weight",
     "weights {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}"),
    (QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="block",
                      block_structure=[128, 64]), "weight",
     ("weights {num_bits: 8, type: int, symmetric: false, strategy: block, "
      "block_structure: [128, 64]}")),
    (QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True), "input",
     "input_activations {num_bits: 8, type: float, symmetric: true, strategy: token}"),
    (QuantizationArgs(num_bits=8, type="int", strategy="channel"), "output",
     "output_activations {num_bits: 8, type: int, symmetric: true, strategy: channel}"),
    (QuantizationArgs(num_bits=8, type="float", strategy="tensor"), "k",
     "k {num_bits: 8, type: float, symmetric: true, strategy: tensor}")],
    ids=["group", "block", "token", "output", "kv"])
def test_recipe_args_are_written_as_a_recipe_writes_them(args, base_name, text):
    assert recipe_args(args, base_name) == text


def test_a_block_schemes_error_names_its_block_structure():
    """quantscope_linear_mse searches symmetric ranges only: refused in the recipe's words."""
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="block",
                            block_structure=[128, 128])
    with pytest.raises(ValueError) as e:
        Observer.load_from_registry("quantscope_linear_mse", base_name="weight", args=args)
    assert "strategy: block, block_structure: [128, 128]}" in str(e.value), str(e.value)


def test_a_symmetric_only_search_on_asymmetric_args_names_the_plugins_observers():
    """The refusal points at the plugin's observers that take asymmetric ranges, not the
    native names the class's own error gives."""
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="channel")
    with pytest.raises(ValueError) as e:
        Observer.load_from_registry("quantscope_linear_mse", base_name="weight", args=args)
    assert str(e.value) == (
        "observer quantscope_linear_mse for weights {num_bits: 8, type: int, symmetric: false, "
        "strategy: channel}: it searches symmetric ranges only, these are asymmetric: use "
        "quantscope_memoryless_mse or quantscope_mse for them"), str(e.value)


def test_a_nan_errors_args_leave_unset_fields_out():
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    obs = Observer.load_from_registry("quantscope_static_minmax", base_name="input", args=args)
    obs(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="observed NaN or inf") as e:
        obs.get_qparams()
    text = str(e.value)
    assert ("input_activations {num_bits: 8, type: float, symmetric: true, strategy: tensor}"
            in text), text
    assert "None" not in text and "block_structure" not in text, text


@pytest.mark.parametrize("fields", [
    {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
     "scale_dtype": torch.uint8, "zp_dtype": torch.uint8},
    {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}],
    ids=["mxfp4", "int4"])
@pytest.mark.parametrize("name", ["quantscope_memoryless_minmax", "quantscope_mse"])
def test_qparams_before_any_data_is_llmcompressors_error(name, fields):
    """``get_qparams`` with no statistics raises llm-compressor's own assertion, as its own
    observers do, MX schemes too: their range is read (for the scale in the dtype) only
    where there are statistics, else quantscope's "called before any tensor was observed"
    ValueError came first."""
    import quantscope.integrations.llmcompressor  # noqa: F401  (registers quantscope_<name>)

    said = []
    for each in ("memoryless_minmax", name):
        obs = Observer.load_from_registry(each, base_name="weight",
                                          args=QuantizationArgs(**fields))
        with pytest.raises(AssertionError) as e:
            obs.get_qparams()
        said.append(str(e.value))
    assert said[0] == said[1] and "No statistics available" in said[1]


@pytest.mark.parametrize(("base_name", "fields", "said"), [
    ("k", {"num_bits": 8, "type": "float", "symmetric": False, "strategy": "tensor",
           "dynamic": False}, "fp8_e4m3 is a float format and is symmetric only"),
    ("weight", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                "scale_dtype": torch.int8}, "quantscope has no integer scale encoding"),
], ids=["asymmetric-fp8-kv", "int8-scale-dtype"])
def test_a_scheme_no_spec_takes_is_refused_naming_the_observer_and_the_recipe(
        base_name, fields, said):
    # probe s59: the spec's own error came bare, naming neither (an observer_kwargs one did)
    args = QuantizationArgs(**fields)
    with pytest.raises(ValueError) as e:
        Observer.load_from_registry("quantscope_static_minmax", base_name=base_name, args=args)
    text = str(e.value)
    assert text.startswith("observer quantscope_static_minmax for "
                           f"{recipe_args(args, base_name)}: "), text
    assert said in text, text
