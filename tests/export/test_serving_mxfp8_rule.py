"""``serving._mxfp8`` is vLLM's ``_is_mxfp8`` (``CompressedTensorsConfig`` in
vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py): strategy
GROUP, type FLOAT, 8 bits, group_size 32, symmetric and ``scale_dtype == torch.uint8`` (E8M0).
Each condition is needed: fp8 weights that miss one are no MXFP8, so vLLM's fused MoE has no
method for them. A mutation round found no test failing where type, bits or strategy was
dropped from the rule.
"""

import pytest

from quantscope.exporters import serving

MXFP8 = {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 32,
         "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}


def test_mxfp8_itself():
    assert serving._mxfp8(MXFP8)


@pytest.mark.parametrize("change", [
    {"type": "int"}, {"num_bits": 4}, {"num_bits": 16},
    {"strategy": "tensor_group"}, {"strategy": "channel"},
    {"group_size": 16}, {"symmetric": False}, {"scale_dtype": "torch.float32"},
])
def test_each_condition_of_is_mxfp8(change):
    assert not serving._mxfp8({**MXFP8, **change})


def test_fp8_tensor_group_experts_are_no_mxfp8():
    # fp8 weights in tensor_group of 32 with E8M0 scales: strategy is not GROUP
    w = {**MXFP8, "strategy": "tensor_group"}
    assert serving.vllm_moe_refusal(w, None, "float-quantized") is not None
