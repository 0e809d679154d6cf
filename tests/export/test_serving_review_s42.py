"""The serving checks read compressed-tensors' args as compressed-tensors does: a field left
out takes its default (``symmetric`` True), and ``block_structure`` comes in either form
(``[128, 128]``, or older compressed-tensors' ``"128x128"``) and is read only where
compressed-tensors takes it (two positive ints)."""

import pytest

from quantscope._plainchecks import block_structure
from quantscope.exporters import consistency, serving

MXFP8 = {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 32,
         "scale_dtype": "torch.uint8"}
NVFP4 = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}


def test_symmetric_left_out_is_symmetric():
    assert serving._mxfp8(MXFP8) and serving._nvfp4(NVFP4)
    assert not serving._mxfp8({**MXFP8, "symmetric": False})
    assert not serving._nvfp4({**NVFP4, "symmetric": False})
    assert serving.vllm_refusal(MXFP8) is None  # served as MXFP8, not refused


@pytest.mark.parametrize("form", [[128, 64], "128x64", "128X64"])
def test_block_structure_in_either_form(form):
    weights = {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": form}
    assert consistency._block_rows(weights) == 128
    assert serving.scheme_args(weights)["block_structure"] == [128, 64]


@pytest.mark.parametrize("bad", [None, "128", "axb", [128], [1, 2, 3], [128.5, 64],
                                 ["128", "64"], [0, 64], [128, -64], "128x0", {"a": 1, "b": 2}])
def test_a_block_structure_compressed_tensors_refuses_is_not_read(bad):
    weights = {"strategy": "block", "block_structure": bad}
    assert consistency._block_rows(weights) is None
    assert serving.scheme_args(weights)["block_structure"] == bad
    with pytest.raises(ValueError, match="block_structure"):
        block_structure("check", bad)
