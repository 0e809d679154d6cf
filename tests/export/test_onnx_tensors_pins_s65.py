"""Pins of the ONNX export's tensor helpers (``exporters/onnx_tensors.py``) from the s65
mutation round: behaviours no earlier test held, each checked against the module's doc and
docstrings (the ONNX spec's 4-bit packing: element ``2i`` in the low nibble of byte ``i``,
signed codes as two's complement nibbles; little-endian ``raw_data``) and
``check_float32_quantize``'s refusal of a float64 ``QuantizeLinear`` input."""

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper

from quantscope.exporters.onnx_tensors import (
    check_float32_quantize,
    code_tensor,
    pack_nibbles,
)


def test_pack_nibbles_puts_the_first_code_in_the_low_nibble():
    """[1, 2, 3]: byte 0 is 0x21 (1 low, 2 high), the odd last code alone in 0x03."""
    assert pack_nibbles(np.array([1, 2, 3], dtype=np.int32)) == bytes([0x21, 0x03])


def test_pack_nibbles_stores_signed_codes_as_twos_complement_nibbles():
    """-1 is 0xF and -8 is 0x8 (int4's two's complement), 7 stays 0x7."""
    assert pack_nibbles(np.array([-1, -8, 7, -6], dtype=np.int32)) == bytes([0x8F, 0xA7])


def test_int16_codes_are_little_endian_raw_data_shaped_as_the_codes():
    t = code_tensor("w", TensorProto.INT16, torch.tensor([[1, -2]], dtype=torch.int16))
    assert t.raw_data == b"\x01\x00\xfe\xff" and list(t.dims) == [1, 2]
    u = code_tensor("u", TensorProto.UINT16, torch.tensor([258], dtype=torch.int32))
    assert u.raw_data == b"\x02\x01"


def test_int4_codes_are_packed_in_raw_data():
    t = code_tensor("w", TensorProto.INT4, torch.tensor([[-1, 2], [3, -8]], dtype=torch.int8))
    assert t.raw_data == bytes([0x2F, 0x83]) and list(t.dims) == [2, 2]


def test_a_code_type_without_integer_storage_is_refused():
    with pytest.raises(ValueError, match="w: no integer storage for ONNX type INT32"):
        code_tensor("w", TensorProto.INT32, torch.zeros(2, dtype=torch.int32))


def _quantize_graph(elem_type):
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="fc/input_q")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", elem_type, [2])],
        [helper.make_tensor_value_info("q", TensorProto.INT8, [2])],
        initializer=[helper.make_tensor("s", TensorProto.FLOAT, [], [0.5]),
                     helper.make_tensor("z", TensorProto.INT8, [], [0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(("elem_type", "name"), [(TensorProto.DOUBLE, "double"),
                                                 (TensorProto.BFLOAT16, "bfloat16")])
def test_a_quantize_linear_reading_float64_or_bf16_is_refused_naming_the_layer(elem_type,
                                                                               name):
    """"reads a float other than float32 (a float64 model, a bf16 constant)"."""
    with pytest.raises(ValueError, match=f"fc: QuantizeLinear reads 'x' as {name}"):
        check_float32_quantize(_quantize_graph(elem_type))


def test_a_float32_quantize_linear_passes_the_check():
    check_float32_quantize(_quantize_graph(TensorProto.FLOAT))
