"""Groups and blocks along an input's axis 1 are refused by the compressed-tensors writer:
``quant_args`` took axis 1 as "the last axis" for every role, but axis 1 of a Linear's
activation ``[batch, seq, hidden]`` is its sequence. apply() quantizes such an input in units
of tokens of one feature; compressed-tensors' ``group`` / ``tensor_group`` strategies (and
vLLM) group the hidden features of each token, so the checkpoint ran another quantization than
apply(), silently. Found by session 64's mutation round over the writer."""

import pytest
import torch
from test_ct_writer_pins_s64 import _args

from quantscope.layout import Block, Group
from quantscope.spec import QuantSpec

pytest.importorskip("compressed_tensors")


def test_an_input_grouped_along_its_axis_1_runs_along_the_sequence_in_apply():
    """The premise: an input's ``Group(8, axis=1)`` groups 8 tokens of one feature."""
    x = torch.arange(2 * 8 * 32, dtype=torch.float32).reshape(2, 8, 32)
    units = Group(8, axis=1).to_units(x)
    assert units[0].tolist() == x[0, :, 0].tolist()  # one feature, tokens 0..7


@pytest.mark.parametrize(("spec", "dynamic"), [
    (QuantSpec("int8", Group(8, axis=1)), True),
    (QuantSpec("fp4_e2m1", Block(16, axis=1), scale="fp8_e4m3"), "local"),
    (QuantSpec("fp4_e2m1", Block(32, axis=1), scale="e8m0:even"), True)])
def test_an_input_grouped_along_its_axis_1_is_refused(spec, dynamic):
    """Not written as compressed-tensors' groups of the hidden features."""
    with pytest.raises(ValueError, match=r"compressed-tensors"):
        _args(spec, "input", dynamic=dynamic)
