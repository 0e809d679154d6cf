"""fp8 weights in groups: vLLM serves them only as MXFP8 (E8M0 scales).

The verdicts come from vLLM's ``_get_scheme_from_parts``
(vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py):
``_is_mxfp8`` needs float 8 bits in symmetric groups of 32 with ``scale_dtype == torch.uint8``
(E8M0); ``_is_wNa16_group_channel`` leads to WNA16 only in format pack-quantized;
``_is_fp8_w8a8`` / ``_is_fp8_w8a16`` take tensor, channel or block weights only; the int
predicates that follow do not match float groups (weight-only: ``_is_static_tensor_w8a8``
reads ``None.num_bits``, an AttributeError; with an input: NotImplementedError). So fp8 groups
with fp32 scales -- what quantscope writes for ``QuantSpec("fp8_e4m3", Group(32))`` -- have
no scheme, weight-only (naive-quantized) or with a dynamic fp8 group input (float-quantized).
"""

import warnings

import pytest
import torch
import transformers

import quantscope
from quantscope import QuantSpec
from quantscope.calibration import Recipe, Role, Rule
from quantscope.cli import main
from quantscope.exporters.consistency import check, format_problems
from quantscope.exporters.serving import vllm_refusal
from quantscope.layout import Group

torch.set_num_threads(1)


def _fp8_group(size=32, **kw):
    return {"type": "float", "num_bits": 8, "strategy": "group", "group_size": size,
            "symmetric": True, "dynamic": False, **kw}


F8_TOK = {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
          "dynamic": True}
E8M0 = {"scale_dtype": "torch.uint8"}
#: (weights, input, format, vLLM's scheme or None where it has none)
VLLM = {
    "fp8 g32 fp32 scales, weight-only": (_fp8_group(), None, "naive-quantized", None),
    "fp8 g32 fp32 scales, dynamic group input": (
        _fp8_group(), _fp8_group(dynamic=True), "float-quantized", None),
    "fp8 g128 fp32 scales, dynamic token input": (
        _fp8_group(128), F8_TOK, "float-quantized", None),
    "fp8 g32 float32 scale_dtype": (_fp8_group(scale_dtype="torch.float32"), None,
                                    "float-quantized", None),
    "fp8 g64 E8M0 scales (no MX size)": (_fp8_group(64, **E8M0), None, "float-quantized",
                                         None),
    "mxfp8 weight-only": (_fp8_group(**E8M0), None, "mxfp8-quantized", "W8A8Mxfp8"),
    "mxfp8": (_fp8_group(**E8M0), _fp8_group(dynamic=True, **E8M0), "mxfp8-quantized",
              "W8A8Mxfp8"),
    "mxfp8, dtype without its torch. prefix": (_fp8_group(scale_dtype="uint8"), None,
                                               "mxfp8-quantized", "W8A8Mxfp8"),
}


@pytest.mark.parametrize("name", sorted(VLLM))
def test_fp8_groups_follow_vllms_is_mxfp8(name):
    weights, inputs, fmt, scheme = VLLM[name]
    why = vllm_refusal(weights, inputs, fmt)
    assert (why is None) == (scheme is not None), (name, why)
    if scheme is None:
        assert "MXFP8" in why and "E8M0" in why and f"groups of {weights['group_size']}" in why


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, [{"input_ids": torch.randint(0, 128, (2, 16))} for _ in range(2)]


_G32 = QuantSpec("fp8_e4m3", Group(32))


@pytest.mark.parametrize("with_input", [False, True])
def test_export_warns_and_check_reports_fp8_groups(llama, tmp_path, capsys, with_input):
    model, batches = llama
    inp = Role(_G32, "memoryless_minmax", dynamic=True) if with_input else None
    recipe = Recipe((Rule(("Linear",), weight=Role(_G32, "memoryless_minmax"), input=inp),),
                    ignore=("lm_head",), name="fp8-g32")
    calib = quantscope.calibrate(model, batches, recipe, progress=False)
    out = str(tmp_path / "ct")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantscope.export(calib, model, out)
    warned = [str(w.message) for w in caught if "vLLM" in str(w.message)]
    assert len(warned) == 1 and "config group 'group_0'" in warned[0], warned
    problems = check(out)
    assert [(p["group"], p["tensor"]) for p in problems] == [("group_0", "config")]
    assert problems[0]["vllm"] in warned[0]
    assert "MXFP8" in problems[0]["vllm"] and "scale_dtype None" in problems[0]["vllm"]
    assert "group_0" in format_problems(problems)
    assert main(["check", out]) == 1
    assert "MXFP8" in capsys.readouterr().out
