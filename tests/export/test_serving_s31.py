"""Two MoE cases of vLLM's fused MoE layer the serving rules counted as served.

The expected verdicts come from vLLM's source, not from quantscope's output:
``CompressedTensorsMoEMethod.get_moe_method``
(vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/
compressed_tensors_moe.py) and the predicates of compressed_tensors.py it calls.

- fp8 weight-only experts (W8A16 fp8): get_moe_method has no ``_is_fp8_w8a16`` branch. Channel
  weights reach ``_is_wNa16_group_channel`` (which reads no type) and raise there (format
  float-quantized, not pack-quantized); tensor or block weights pass every branch to
  ``_is_dynamic_token_w8a8``, which reads ``input_quant.num_bits`` of None: no GPU loads them.
- mxfp8 experts (fp8 groups of 32, E8M0 scales): ``_is_mxfp8`` reaches
  CompressedTensorsW8A8Mxfp8MoEMethod before the WNA16 branch, with or without an input (it
  quantizes activations at run time).
- W4A8 int experts (int4 weights, dynamic per-token int8 input): ``_is_dynamic_token_w4a8_int``
  reaches CompressedTensorsW4A8Int8MoEMethod, whose backend (select_w4a8_int8_moe_backend) is
  CPU only; the report says so, naming the platform.
"""


import pytest
from test_serving_s30 import _moe_export
from tiny_models import mixtral

from quantscope import QuantSpec, Tensor, Token
from quantscope import presets as P
from quantscope.calibration import Recipe, Role, Rule
from quantscope.cli import main
from quantscope.exporters.consistency import check, format_problems
from quantscope.exporters.serving import vllm_moe_refusal, vllm_refusal


def _args(type_, bits, strategy, dynamic=False, symmetric=True, **kw):
    return {"type": type_, "num_bits": bits, "strategy": strategy, "dynamic": dynamic,
            "symmetric": symmetric, **kw}


F8_T, F8_CH = _args("float", 8, "tensor"), _args("float", 8, "channel")
F8_BLOCK = _args("float", 8, "block", block_structure=[128, 128])
F8_TOK = _args("float", 8, "token", dynamic=True)
I4_G, I4_CH = _args("int", 4, "group", group_size=128), _args("int", 4, "channel")
I8_CH = _args("int", 8, "channel")
I8_TOK = _args("int", 8, "token", dynamic=True)
MX8 = _args("float", 8, "group", group_size=32, scale_dtype="torch.uint8")

#: (weights, input, format, what get_moe_method does on a GPU: the method, or how it fails)
GPU_MOE = {
    "fp8 tensor weight-only": (F8_T, None, "float-quantized",
                               "AttributeError (_is_dynamic_token_w8a8 reads None.num_bits)"),
    "fp8 block weight-only": (F8_BLOCK, None, "float-quantized",
                              "AttributeError (_is_dynamic_token_w8a8 reads None.num_bits)"),
    "fp8 channel weight-only": (F8_CH, None, "float-quantized",
                                "ValueError (WNA16 branch: format not pack-quantized)"),
    "w4a8 int, group weights": (I4_G, I8_TOK, "int-quantized",
                                "NotImplementedError (W4A8 Int8 MoE: CPU platforms only)"),
    "w4a8 int, channel weights": (I4_CH, I8_TOK, "int-quantized",
                                  "NotImplementedError (W4A8 Int8 MoE: CPU platforms only)"),
    "w4a8 int, asymmetric input": (I4_G, dict(I8_TOK, symmetric=False), "int-quantized",
                                   "NotImplementedError (W4A8 Int8 MoE: CPU platforms only)"),
    # peers that stay served: the branches around the two cases
    "fp8 tensor / tensor": (F8_T, F8_T, "float-quantized", "W8A8Fp8MoE"),
    "fp8-dynamic": (F8_CH, F8_TOK, "float-quantized", "W8A8Fp8MoE"),
    "w8a8-dynamic": (I8_CH, I8_TOK, "int-quantized", "W8A8Int8MoE"),
    "w4a16": (I4_G, None, "pack-quantized", "WNA16 Marlin MoE"),
    # _is_mxfp8 comes before the WNA16 branch and reads no input: MXFP8 activations at run
    # time (session 33: weight-only mxfp8 experts were reported as refused)
    "mxfp8 weight-only": (MX8, None, "mxfp8-quantized", "W8A8Mxfp8MoE"),
    "mxfp8 / mxfp8": (MX8, dict(MX8, dynamic=True), "mxfp8-quantized", "W8A8Mxfp8MoE"),
    # fp8 groups of another size, or with fp32 scales, are no MX (_is_mxfp8 reads
    # scale_dtype): the WNA16 branch refuses their format
    "fp8 group-32 fp32 scales weight-only": (
        dict(MX8, scale_dtype=None), None, "float-quantized",
        "ValueError (WNA16 branch: format)"),
    "fp8 group-128 weight-only": (_args("float", 8, "group", group_size=128), None,
                                  "float-quantized", "ValueError (WNA16 branch: format)"),
}
_SERVED = {"W8A8Fp8MoE", "W8A8Int8MoE", "WNA16 Marlin MoE", "W8A8Mxfp8MoE"}


@pytest.mark.parametrize("name", sorted(GPU_MOE))
def test_moe_rule_follows_get_moe_method_on_a_gpu(name):
    weights, inputs, fmt, outcome = GPU_MOE[name]
    why = vllm_moe_refusal(weights, inputs, fmt)
    assert (why is None) == (outcome in _SERVED), (name, why)
    if "CPU platforms only" in outcome:
        assert "on CPU only" in why and "w4a16" in why
    elif "AttributeError" in outcome:
        assert "weight-only" in why and "fp8-dynamic" in why


def test_moe_rules_leave_the_dense_verdicts_alone():
    # a dense Linear has W8A16 fp8 (_is_fp8_w8a16) and CompressedTensorsW4A8Int (capability 1)
    assert vllm_refusal(F8_T, None, "float-quantized") is None
    assert vllm_refusal(F8_BLOCK, None, "float-quantized") is None
    assert vllm_refusal(I4_G, I8_TOK, "int-quantized") is None


_W4A8_DYNAMIC = (Role(P.INT4_GROUP128, "minmax"),
                 Role(P.INT8_PER_TOKEN, "memoryless_minmax", True))
#: recipe name -> (weight role, input role or None, words the experts' report holds); block fp8
#: experts do not export (gate and up are written apart, a tile spans both)
MOE_EXPORTS = {
    "fp8 tensor weight-only": (Role(QuantSpec("fp8_e4m3", Tensor()), "minmax"), None,
                               ("weight-only float8 tensor", "fp8-dynamic")),
    "w4a8 dynamic": (*_W4A8_DYNAMIC, ("on CPU only", "on a GPU", "w4a16")),
}


@pytest.mark.parametrize("name", sorted(MOE_EXPORTS))
def test_export_warns_and_check_reports_the_experts(tmp_path, capsys, name):
    weight, inp, words = MOE_EXPORTS[name]
    recipe = Recipe((Rule(("Linear",), weight=weight, input=inp),), ("lm_head",), name)
    out = str(tmp_path / "out")
    warned = _moe_export(mixtral, recipe, out)
    problems = check(out)
    # the dense Linears of the group are served: the one problem is the experts'
    assert len(warned) == len(problems) == 1, (warned, problems)
    assert (problems[0]["group"], problems[0]["tensor"]) == ("group_0", "config")
    why = problems[0]["vllm"]
    assert why in warned[0] and "config group 'group_0'" in warned[0]
    assert ".experts.0." in why and all(w in why for w in words), why
    assert "vLLM refuses it" not in warned[0]  # the line names where vLLM runs it
    assert "MoE" in format_problems(problems)
    assert main(["check", out]) == 1
    capsys.readouterr()


def test_fp8_dynamic_experts_stay_served(tmp_path):
    recipe = Recipe((Rule(("Linear",), weight=Role(P.FP8_PER_CHANNEL, "minmax"),
                          input=Role(QuantSpec("fp8_e4m3", Token()), "memoryless_minmax",
                                     True)),), ("lm_head",), "fp8-dyn")
    out = str(tmp_path / "out")
    assert _moe_export(mixtral, recipe, out) == []
    assert check(out) == []
