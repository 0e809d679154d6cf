"""Pins of ``quantscope.exporters.serving``'s vLLM rules that no other test held: static
weights for fp8 and WNA16 / W4A8 int schemes, the dynamic per-tensor int8 input W8A8 has no
scheme for, the symmetric dynamic per-token or per-group input of WNA8, the static output of
WNA8O8, the int bits a refusal names, ``_is_nvfp4_format``'s groups of 16 and the symmetric
weights of the int8 MoE. They came from a mutation round (s68): each test fails on a small
defect of serving.py that the existing tests let pass. The expected verdicts are vLLM's
predicates as serving.py's docstrings cite them (``_get_scheme_from_parts``,
``CompressedTensorsMoEMethod.get_moe_method``).
"""

import pytest
import torch
from test_serving_arg_defaults import A8, FP8, FP8_TENSOR, FP8_TOKEN, NVFP4, W4, W8

from quantscope.exporters.serving import (
    embedding_layers,
    resolver,
    unservable,
    vllm_moe_refusal,
    vllm_refusal,
)

F8_BLOCK = dict(FP8, strategy="block", block_structure=[128, 128])
#: a static per-tensor int8 input (or output): W8A8's and WNA8O8's
I8_STATIC = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}
#: int8 weights in groups: no W8A8 (tensor / channel) nor W4A8 (int4) scheme takes them
W8_GROUP = dict(W8, strategy="group", group_size=128)


@pytest.mark.parametrize("change", [{"dynamic": True}, {"symmetric": False}],
                         ids=["dynamic", "asymmetric"])
def test_fp8_weights_are_served_only_static_and_symmetric(change):
    """``_is_fp8_w8a8`` / ``_is_fp8_w8a16`` need symmetric static weights."""
    why = vllm_refusal(dict(FP8, **change), FP8_TOKEN, "float-quantized")
    assert why is not None and "only static and symmetric" in why


def test_fp8_blocks_take_a_dynamic_per_tensor_input():
    """The block kernel's assert is on a static input only: a dynamic per-tensor input is
    served (``_is_fp8_w8a8``: dynamic inputs always supported)."""
    assert vllm_refusal(F8_BLOCK, dict(FP8_TENSOR, dynamic=True), "float-quantized") is None
    assert vllm_refusal(F8_BLOCK, FP8_TENSOR, "float-quantized") is not None


def test_fp8_blocks_with_a_static_per_token_input_are_no_static_w8a8_input():
    """``_is_fp8_w8a8`` takes a static input only symmetric per tensor, so a static per-token
    input never reaches W8A8Fp8's block assert: no rule here refuses it."""
    static_token = dict(FP8_TOKEN, dynamic=False)
    assert vllm_refusal(F8_BLOCK, static_token, "float-quantized") is None


def test_weight_only_int_weights_must_be_static_for_wna16():
    """``_is_wNa16_group_channel`` needs static weights: dynamic ones have no scheme."""
    assert vllm_refusal(W4, None, "pack-quantized") is None
    why = vllm_refusal(dict(W4, dynamic=True), None, "pack-quantized")
    assert why is not None and "WNA16" in why


def test_a_dynamic_per_tensor_int8_input_is_no_w8a8():
    """``_is_static_tensor_w8a8`` needs a static input, ``_is_dynamic_token_w8a8`` a per-token
    one: int8 channel weights with a dynamic per-tensor input have no scheme."""
    assert vllm_refusal(W8, I8_STATIC, "int-quantized") is None
    why = vllm_refusal(W8, dict(I8_STATIC, dynamic=True), "int-quantized")
    assert why is not None and "(its W8A8 scheme)" in why


def test_w4a8_needs_static_int4_weights():
    """``_is_dynamic_token_w4a8_int``: ``not weight_quant.dynamic and input_quant.dynamic``."""
    assert vllm_refusal(W4, A8, "int-quantized") is None
    why = vllm_refusal(dict(W4, dynamic=True), A8, "int-quantized")
    assert why is not None and why.startswith("vLLM serves int4 weights with an int8 input")


@pytest.mark.parametrize(("inputs", "served"), [
    (A8, True),
    (dict(A8, strategy="group", group_size=128), True),
    (dict(A8, symmetric=False), False),
], ids=["token", "group", "asymmetric token"])
def test_wna8_takes_a_dynamic_symmetric_per_token_or_per_group_input(inputs, served):
    """Packed int8 group weights with a dynamic int8 input are WNA8 only where that input
    is symmetric, per token or per group."""
    assert (vllm_refusal(W8_GROUP, inputs, "pack-quantized") is None) == served


def test_wna8o8_needs_a_static_int8_output():
    """``_is_wNa8o8_int``: a static per-tensor int8 input and output; a dynamic output is
    no such scheme."""
    w2 = dict(W4, num_bits=2)
    assert vllm_refusal(w2, I8_STATIC, "int-quantized", I8_STATIC) is None
    assert vllm_refusal(w2, I8_STATIC, "int-quantized", dict(I8_STATIC, dynamic=True)) \
        is not None


def test_unservable_reads_a_groups_output_activations():
    """``unservable`` judges a group with its ``output_activations`` too: WNA8O8 served."""
    group = {"targets": ["Linear"], "weights": dict(W4, num_bits=2),
             "input_activations": I8_STATIC}
    qc = {"format": "int-quantized", "config_groups": {"g": group}}
    assert [n for n, _, _ in unservable(qc)] == ["g"]
    group["output_activations"] = I8_STATIC
    assert unservable(qc) == []


def test_int2_weights_with_an_int8_input_are_named_int2():
    """The refusal names the weights' own bits (int2: WNA8 only), not int4's W4A8 rule."""
    why = vllm_refusal(dict(W4, num_bits=2), I8_STATIC, "int-quantized")
    assert why.startswith("vLLM serves int2 weights with an int8 input only ")
    assert "W4A8 scheme" not in why.split(";")[0]


def test_nvfp4_experts_need_tensor_groups_of_16():
    """``_is_nvfp4_format``: fp4 ``tensor_group`` weights of 16; of 32 vLLM's fused MoE has
    no weight-only method for them."""
    assert vllm_moe_refusal(NVFP4, None, "nvfp4-pack-quantized") is None
    why = vllm_moe_refusal(dict(NVFP4, group_size=32), None, "nvfp4-pack-quantized")
    assert why is not None and "no method for weight-only" in why


def test_int8_experts_need_symmetric_weights():
    """``_is_dynamic_token_w8a8`` needs symmetric weights: asymmetric int8 channel experts
    with a dynamic per-token input have no fused-MoE method."""
    assert vllm_moe_refusal(W8, A8, "int-quantized") is None
    why = vllm_moe_refusal(dict(W8, symmetric=False), A8, "int-quantized")
    assert why is not None and why.startswith("vLLM's int8 MoE takes only channel int8")


def test_a_model_that_is_an_embedding_names_no_embedding_layer():
    """``embedding_layers`` names submodules: the root (name "") is no layer of a folder."""
    assert embedding_layers(torch.nn.Embedding(4, 2)) == []
    assert embedding_layers(torch.nn.Sequential(torch.nn.Embedding(4, 2))) == ["0"]


@pytest.mark.parametrize("layer", [
    "model.layers.0.mlp.down_proj", "model.layers.10.mlp", "x.model.layers.0.mlp"])
def test_re_targets_match_from_the_start_of_the_name(layer):
    """A ``re:`` target selects a layer as compressed-tensors' ``match_name`` does:
    ``re.match``, anchored at the start of the name but not at its end."""
    selected = resolver([(r"re:model\.layers\.[0-9]\.mlp", "g")])(layer) == {"g"}
    assert selected == (layer == "model.layers.0.mlp.down_proj")


def test_a_re_target_without_a_dot_is_no_class_name():
    """Class names are the targets without a dot and without ``re:``: ``re:lm_head`` selects
    the layers it matches, never the others as a class name would."""
    of = resolver([("re:lm_head", "head"), ("Linear", "rest")])
    assert of("lm_head") == {"head"}
    assert of("model.layers.0.self_attn.q_proj") == {"rest"}
